//! Peer numbers for `fa bench --peers`: PyTorch SDPA's forward (and, from
//! `scripts/torch_sdpa.py --backward`, backward) TFLOP/s per shape, as the script's `--json`
//! writes them (measured in the same device session), and our throughput over theirs.

use crate::error::CliError;
use flash_attention::shapes::BenchShape;
use std::path::Path;

/// One shape of the peers file: its key and PyTorch SDPA's forward TFLOP/s per backend.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct PeerRow {
    /// Head dimension.
    pub hdim: usize,
    /// Tokens per sequence (queries = keys).
    pub seqlen: usize,
    /// Sequences, when the file gives them.
    #[serde(default)]
    pub batch: Option<usize>,
    /// Heads, when the file gives them.
    #[serde(default)]
    pub heads: Option<usize>,
    /// Causal mask.
    pub causal: bool,
    /// SDPA's FlashAttention-2 backend, TFLOP/s (absent when it failed).
    #[serde(default)]
    pub flash_fwd_tflops: Option<f64>,
    /// SDPA's cuDNN backend, TFLOP/s (absent when it failed).
    #[serde(default)]
    pub cudnn_fwd_tflops: Option<f64>,
    /// SDPA's FlashAttention-2 backward, TFLOP/s (`--backward` runs of the script only).
    #[serde(default)]
    pub flash_bwd_tflops: Option<f64>,
    /// SDPA's cuDNN backward, TFLOP/s (`--backward` runs of the script only).
    #[serde(default)]
    pub cudnn_bwd_tflops: Option<f64>,
}

impl PeerRow {
    /// Whether this row measured `shape` (self-attention, same mask, and the same batch and
    /// heads where the file records them).
    pub fn matches(&self, shape: &BenchShape) -> bool {
        self.hdim == shape.head_dim
            && self.seqlen == shape.seqlen_q
            && self.seqlen == shape.seqlen_k
            && self.causal == shape.causal
            && self.batch.is_none_or(|b| b == shape.batch)
            && self
                .heads
                .is_none_or(|h| h == shape.heads && h == shape.heads_kv)
    }
}

/// Parses a peers file: a JSON array of rows (what `--json` writes) or one JSON object per
/// line (what the script prints). Unknown keys are ignored.
pub fn parse_peers(text: &str) -> Result<Vec<PeerRow>, String> {
    if text.trim_start().starts_with('[') {
        return serde_json::from_str(text).map_err(|e| e.to_string());
    }
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).map_err(|e| e.to_string()))
        .collect()
}

/// Reads and parses a peers file.
pub fn read_peers(path: &Path) -> Result<Vec<PeerRow>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_peers(&text).map_err(|reason| CliError::BadFile {
        path: path.to_path_buf(),
        reason,
    })
}

/// Our throughput beside the peers' for one shape; serialised into `fa bench --json` lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PeerRatios {
    /// PyTorch SDPA flash, TFLOP/s.
    pub peer_flash_tflops: Option<f64>,
    /// PyTorch SDPA cuDNN, TFLOP/s.
    pub peer_cudnn_tflops: Option<f64>,
    /// Our TFLOP/s over SDPA flash's.
    pub vs_flash: Option<f64>,
    /// Our TFLOP/s over SDPA cuDNN's.
    pub vs_cudnn: Option<f64>,
}

/// The ratios of `tflops` (ours, for `shape`'s forward) over the first matching peer row.
pub fn ratios(peers: &[PeerRow], shape: &BenchShape, tflops: f64) -> PeerRatios {
    let peer = peers.iter().find(|p| p.matches(shape));
    pair(
        peer.and_then(|p| p.flash_fwd_tflops),
        peer.and_then(|p| p.cudnn_fwd_tflops),
        tflops,
    )
}

/// The ratios of `tflops` (ours, for `shape`'s backward, 2.5 × the forward's FLOPs as the
/// script counts them) over the first matching peer row's backward numbers.
pub fn backward_ratios(peers: &[PeerRow], shape: &BenchShape, tflops: f64) -> PeerRatios {
    let peer = peers.iter().find(|p| p.matches(shape));
    pair(
        peer.and_then(|p| p.flash_bwd_tflops),
        peer.and_then(|p| p.cudnn_bwd_tflops),
        tflops,
    )
}

fn pair(flash: Option<f64>, cudnn: Option<f64>, tflops: f64) -> PeerRatios {
    PeerRatios {
        peer_flash_tflops: flash,
        peer_cudnn_tflops: cudnn,
        vs_flash: flash.map(|x| tflops / x),
        vs_cudnn: cudnn.map(|x| tflops / x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_scripts_array_and_lines_and_divides() {
        let array = r#"[
 {"hdim": 128, "seqlen": 8192, "batch": 2, "heads": 16, "causal": false,
  "flash_fwd_tflops": 400.0, "cudnn_fwd_tflops": 500.0, "efficient_fwd_tflops": 200.0},
 {"hdim": 128, "seqlen": 8192, "batch": 2, "heads": 16, "causal": true,
  "flash_fwd_tflops": 300.0, "cudnn_error": "no kernel"}
]"#;
        let rows = parse_peers(array).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].cudnn_fwd_tflops, None);
        let lines: String = array
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split("},")
            .map(|o| format!("{}}}\n", o.trim().trim_end_matches('}').replace('\n', " ")))
            .collect();
        assert_eq!(parse_peers(&lines).unwrap(), rows);

        let shape = BenchShape::paper(8192, 128, false);
        let r = ratios(&rows, &shape, 440.0);
        assert_eq!(r.peer_flash_tflops, Some(400.0));
        assert!((r.vs_flash.unwrap() - 1.1).abs() < 1e-12);
        assert!((r.vs_cudnn.unwrap() - 0.88).abs() < 1e-12);
        let causal = ratios(&rows, &BenchShape::paper(8192, 128, true), 150.0);
        assert_eq!((causal.vs_flash, causal.vs_cudnn), (Some(0.5), None));
        // Another batch is another shape.
        let other = BenchShape { batch: 1, ..shape };
        assert_eq!(ratios(&rows, &other, 1.0), PeerRatios::default());
        assert!(parse_peers("[{\"hdim\": 1}]").is_err());
    }

    #[test]
    fn backward_rows_give_backward_ratios() {
        let rows = parse_peers(
            r#"{"hdim": 64, "seqlen": 2048, "batch": 8, "heads": 32, "causal": true, "flash_fwd_tflops": 300.0, "flash_bwd_tflops": 200.0, "cudnn_bwd_tflops": 400.0}"#,
        )
        .unwrap();
        let shape = BenchShape::paper(2048, 64, true);
        let r = backward_ratios(&rows, &shape, 300.0);
        assert_eq!(r.peer_flash_tflops, Some(200.0));
        assert!((r.vs_flash.unwrap() - 1.5).abs() < 1e-12);
        assert!((r.vs_cudnn.unwrap() - 0.75).abs() < 1e-12);
        // A forward-only file has no backward numbers.
        let fwd =
            parse_peers(r#"{"hdim": 64, "seqlen": 2048, "causal": true, "flash_fwd_tflops": 1.0}"#)
                .unwrap();
        assert_eq!(backward_ratios(&fwd, &shape, 1.0), PeerRatios::default());
    }
}
