"""The compile report's reader of dot work replication, on TTGIR text stored from real compiles.

The excerpts are the layout definitions and dot ops of triton 3.9's sm_90 TTGIR for two forward
configs (bf16, head_dim 64): 64x64 with 8 warps, where the score dot ``s`` (which feeds the P @ V
dot) puts all 8 warps along its 64 rows, so the second warp group repeats the first one's product,
and 64x64 with 4 warps, where nothing repeats; and of the dk/dv kernel at 32x64 with 8 warps
(64 keys: both score-type dots twice). The slow test in test_compile_report.py compiles a known
duplicating config and checks the reader on the live compiler output too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import attention as bench  # noqa: E402

FWD_64x64_W8 = """
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [8, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
#shared = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = false, elementBitWidth = 16}>
      %s_210 = ttng.warp_group_dot %q_90, %kt_208, %cst_2 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem, mutable> -> tensor<64x64xf32, #mma> loc(#loc235)
      %s_211:4 = ttng.warp_group_dot_wait %s_210, %q_90, %kt_208, %arg21 {pendings = 0 : i32} : tensor<64x64xf32, #mma>, !ttg.memdesc<64x64xbf16, #shared, #smem>, !ttg.memdesc<64x64xbf16, #shared1, #smem, mutable>, tensor<64x64xf32, #mma1> loc(#loc235)
      %acc_230 = ttng.warp_group_dot %acc_229, %v_209, %acc_227 {inputPrecision = 0 : i32, isAsync = true} : tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 2}>> * !ttg.memdesc<64x64xbf16, #shared, #smem, mutable> -> tensor<64x64xf32, #mma1> loc(#loc261)
"""  # noqa: E501

FWD_64x64_W4 = """
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 64, 16]}>
      %s_209 = ttng.warp_group_dot %q_89, %kt_207, %cst_15 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem, mutable> -> tensor<64x64xf32, #mma> loc(#loc235)
      %acc_229 = ttng.warp_group_dot %acc_228, %v_208, %acc_226 {inputPrecision = 0 : i32, isAsync = true} : tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * !ttg.memdesc<64x64xbf16, #shared, #smem, mutable> -> tensor<64x64xf32, #mma> loc(#loc261)
"""  # noqa: E501

DKDV_32x64_W8 = """
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 16, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
          %st_203 = ttng.warp_group_dot %x_32, %st_198, %cst_1 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x32xbf16, #shared2, #smem, mutable> -> tensor<64x32xf32, #mma> loc(#loc278)
          %dv_225 = ttng.warp_group_dot %dv_224, %do_199, %dv_173 {inputPrecision = 0 : i32, isAsync = true} : tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 2}>> * !ttg.memdesc<32x64xbf16, #shared, #smem, mutable> -> tensor<64x64xf32, #mma1> loc(#loc334)
          %dpt_226 = ttng.warp_group_dot %x_42, %dpt, %cst_1 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x32xbf16, #shared2, #smem, mutable> -> tensor<64x32xf32, #mma> loc(#loc335)
          %dk_233 = ttng.warp_group_dot %dk_232, %q_197, %dk_172 {inputPrecision = 0 : i32, isAsync = true} : tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 2}>> * !ttg.memdesc<32x64xbf16, #shared, #smem, mutable> -> tensor<64x64xf32, #mma1> loc(#loc340)
"""  # noqa: E501

# An FMA dot (no tensor cores) in the generic print form with a blocked result, and an MMA v2
# dot with the layout written inline: the reader handles both.
FMA_AND_MMA_V2 = """
#blocked = #ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>
    %p_5 = tt.dot %a, %b, %c, inputPrecision = ieee : tensor<8x16xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<16x32xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<8x32xf32, #blocked>
    %q_7 = tt.dot %a, %b, %c : tensor<32x16xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma2}>> * tensor<16x64xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma2}>> -> tensor<32x64xf32, #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [2, 2], instrShape = [16, 8]}>>
"""  # noqa: E501


def _by_name(ttgir: str) -> dict[str, dict]:
    return {d["dot"]: d for d in bench.dot_replication(ttgir)}


def test_score_dot_of_a_64_row_tile_with_8_warps_is_computed_twice():
    dots = _by_name(FWD_64x64_W8)
    assert set(dots) == {"s", "acc"}  # the dot_wait op is no dot
    s = dots["s"]
    assert (s["M"], s["N"], s["K"], s["version"], s["warpsPerCTA"]) == (64, 64, 64, 3, [8, 1])
    assert s["replication"] == 2  # 8 warps x 16 rows = 128 rows for a 64-row tile
    assert dots["acc"]["replication"] == 1  # [4, 2] x (16 x 32) tiles 64 x 64 exactly


def test_four_warps_on_a_64_row_tile_repeat_nothing():
    assert [d["replication"] for d in bench.dot_replication(FWD_64x64_W4)] == [1, 1]


def test_dkdv_with_64_keys_and_8_warps_repeats_both_score_dots():
    dots = _by_name(DKDV_32x64_W8)
    assert {name: d["replication"] for name, d in dots.items()} == {"st": 2, "dpt": 2, "dv": 1, "dk": 1}


def test_blocked_and_inline_mma_layouts():
    dots = _by_name(FMA_AND_MMA_V2)
    # blocked: rows 1 x 4 threads = 4 per warp; 4 warps along M cover 16 rows of an 8-row tile
    assert dots["p"]["layout"] == "blocked" and dots["p"]["replication"] == 2
    # v2 inline: 2 x 2 warps of 16 x 8 over 32 x 64: every warp distinct
    assert dots["q"]["version"] == 2 and dots["q"]["replication"] == 1


def test_layout_replication_rule():
    mma = {"kind": "nvidia_mma", "warpsPerCTA": [8, 1], "instrShape": [16, 64, 16]}
    assert bench.layout_replication(mma, [128, 64]) == 1
    assert bench.layout_replication(mma, [64, 64]) == 2
    assert bench.layout_replication(mma, [32, 64]) == 4
    wide = {"kind": "nvidia_mma", "warpsPerCTA": [4, 2], "instrShape": [16, 64, 16]}
    assert bench.layout_replication(wide, [64, 64]) == 2  # both warp columns on the same 64 columns
    with pytest.raises(ValueError, match="unknown dot result layout"):
        bench.layout_replication({"kind": "amd_mfma", "warpsPerCTA": [4, 1]}, [64, 64])


def test_unreadable_dot_types_are_an_error_not_a_silent_one():
    with pytest.raises(ValueError, match="cannot read the types"):
        bench.dot_replication("    %s_1 = tt.dot %a, %b, %c : something new\n")
