// softmax-core's `Mask` on the device: a bottom-right aligned window (left, right), -1 meaning
// unbounded. Query i sees keys [KEY_LO(i), KEY_HI(i)), both non-decreasing in i, so the tiles of
// a block of queries classify as full / partial / empty exactly as `Mask::classify_tile` does.
#ifndef FA_COMMON_MASK_CUH
#define FA_COMMON_MASK_CUH

#include "common/ptx.cuh"

#define NEG_INF (__int_as_float(0xff800000))

// First visible key of query i, diag = seqlen_k - seqlen_q; and one past the last one. Macros,
// not functions: as inline functions they change the order NVRTC emits the kernel's loads in,
// and with it ptxas' register allocation (a spill in the 4-warp hdim-64 kernels).
#define KEY_LO(i, diag, win_left) ((win_left) >= 0 ? max((i) + (diag) - (win_left), 0) : 0)
#define KEY_HI(i, diag, win_right, seqlen_k) \
    ((win_right) >= 0 ? min((i) + (diag) + (win_right) + 1, (seqlen_k)) : (seqlen_k))

// Compile-time tags of a tile body: partial tiles apply the mask element by element.
struct MaskedTile { static constexpr bool value = true; };
struct FullTile { static constexpr bool value = false; };

// The score x of key `col` for a row that sees [lo, hi): x itself or -inf. A select, not a
// branch: a branch splits the tile body into blocks that ptxas cannot schedule across (-7-10 %,
// docs/history/gpu-notes.md, 2026-11-30). A macro for the reason KEY_LO is one.
#define MASK_SCORE(x, col, lo, hi) (((col) < (lo) || (col) >= (hi)) ? NEG_INF : (x))

#endif // FA_COMMON_MASK_CUH
