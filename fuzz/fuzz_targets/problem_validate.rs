//! `ProblemDesc::validate` on arbitrary shapes, strides, varlen prefix sums, KV-cache layouts,
//! masks, scales and softcaps: it never panics or overflows (the fuzz build checks integer
//! overflow), and when it accepts, every element any backend addresses — each tensor's
//! offsets at the corners of every index range, and every used block of a paged cache — lies
//! inside `min_buffer_lens`, and the score factors are finite.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softmax_core::{KvCache, Mask, ProblemDesc, Sequences, Strides, Tensor};

/// Reads little-endian values from the fuzz input; zeros once it runs out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.0 = rest;
        first
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        (self.u32() as u64) | ((self.u32() as u64) << 32)
    }
    /// Mostly small sizes, sometimes any `usize` (overflow hunting).
    fn size(&mut self) -> usize {
        match self.u8() % 8 {
            0 => self.u64() as usize,
            1 => self.u32() as usize,
            _ => self.u8() as usize,
        }
    }
    fn f32(&mut self) -> f32 {
        f32::from_bits(self.u32())
    }
    fn u32s(&mut self) -> Vec<u32> {
        let n = self.u8() % 12;
        (0..n).map(|_| if self.u8() % 4 == 0 { self.u32() } else { self.u8() as u32 }).collect()
    }
}

fn corners(n: usize) -> Vec<usize> {
    match n {
        0 => vec![],
        1 => vec![0],
        _ => vec![0, n - 1],
    }
}

fuzz_target!(|data: &[u8]| {
    let mut r = Bytes(data);
    let (heads_q, heads_kv, head_dim) = (r.size(), r.size(), r.size());
    let cu_q = r.u32s();
    let cu_k = r.u32s();
    let seqused = r.u32s();
    let table: Vec<i32> = (0..r.u8() % 16).map(|_| r.u32() as i32).collect();
    let sequences = match r.u8() % 3 {
        0 => Sequences::Fixed { batch: r.size(), seqlen_q: r.size(), seqlen_k: r.size() },
        1 => Sequences::Varlen { cu_seqlens_q: &cu_q, cu_seqlens_k: &cu_k },
        _ => Sequences::VarlenDevice {
            batch: r.size(),
            total_q: r.size(),
            total_k: r.size(),
            max_seqlen_q: r.size(),
            max_seqlen_k: r.size(),
        },
    };
    let mut desc = ProblemDesc::new(1, 1, 1, heads_q, heads_kv, head_dim)
        .with_sequences(sequences)
        .head_dim_v(r.size());
    desc = desc.with_mask(Mask::from_flash_args(
        r.u8() % 2 == 0,
        r.u32() as i32 as i64,
        r.u32() as i32 as i64,
    ));
    if r.u8() % 2 == 0 {
        desc = desc.scale(r.f32());
    }
    if r.u8() % 2 == 0 {
        desc = desc.softcap(r.f32());
    }
    match r.u8() % 3 {
        0 => {}
        1 => desc = desc.padded_cache(&seqused),
        _ => desc = desc.paged_cache(&seqused, &table, r.size(), r.size(), r.size()),
    }
    for t in [Tensor::Q, Tensor::K, Tensor::V, Tensor::O] {
        if r.u8() % 3 == 0 {
            desc = desc.strides(t, Strides { batch: r.size(), seq: r.size(), head: r.size() });
        }
    }
    let max_head_dim = r.size();
    let Ok(p) = desc.validate(max_head_dim) else { return };

    // Accepted: the score factors are finite (no silent NaN from the settings).
    let t = p.score_transform::<f32>();
    assert!(t.pre_factor().is_finite(), "{desc:?}");
    assert!(t.softcap_post_factor().is_none_or(|x| x.is_finite()), "{desc:?}");
    let lens = p.min_buffer_lens();
    p.check_buffers(lens).expect("min_buffer_lens passes check_buffers");
    if !p.has_host_seqlens() {
        return;
    }
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let batches: Vec<usize> = if p.batch() <= 8 {
        (0..p.batch()).collect()
    } else {
        corners(p.batch())
    };
    for &b in &batches {
        let seq = p.seq(b);
        for i in corners(seq.seqlen_q) {
            for h in corners(p.heads_q()) {
                assert!(p.q_offset(b, i, h) + d <= lens.q, "q {desc:?}");
                assert!(p.o_offset(b, i, h) + dv <= lens.o, "o {desc:?}");
                if let Some(l) = lens.lse {
                    assert!(p.lse_offset(b, h, i) < l, "lse {desc:?}");
                }
            }
        }
        // Keys: the corners of every used block of a paged cache, else of the whole range.
        let keys: Vec<usize> = match p.kv_cache() {
            KvCache::Paged { block_size, .. } if seq.seqlen_k <= 1 << 12 => (0..seq.seqlen_k)
                .filter(|j| j % block_size == 0 || (j + 1) % block_size == 0 || j + 1 == seq.seqlen_k)
                .collect(),
            KvCache::Paged { .. } => return,
            _ => corners(seq.seqlen_k),
        };
        for j in keys {
            for h in corners(p.heads_kv()) {
                assert!(p.k_offset(b, j, h) + d <= lens.k, "k {desc:?}");
                assert!(p.v_offset(b, j, h) + dv <= lens.v, "v {desc:?}");
            }
        }
    }
});
