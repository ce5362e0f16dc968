"""benchmarks/kernel_counters.py: reading Nsight Compute's details page and its SASS source page (the layouts
ncu 2025.3 prints; the GPU run itself is the benchmark's)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import pytest  # noqa: E402
from kernel_counters import parse_details, parse_sass  # noqa: E402

DETAILS = """[1343] python3.12@127.0.0.1
  void unnamed>::amax_vec_kernel<__nv_bfloat16>(const T1 *, long) (128, 128, 1)x(256, 1, 1), Context 1, Stream 14
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle      823,457
    DRAM Throughput                   %        83.04
    Duration                         us       135.01
    ----------------------- ----------- ------------
    Section: Compute Workload Analysis
    Executed Ipc Active   inst/cycle         2.92
    Issue Slots Busy               %        71.05
    OPT   ALU is the highest-utilized pipeline (64.7%) based on elapsed cycles in the workload
    Registers Per Thread             register/thread              64
    Achieved Occupancy                        %        45.49
  void unnamed>::quantize_tile_kernel<__nv_bfloat16, 1, 1, 3>(Params) (128, 128, 1)x(256, 1, 1), Context 1
    DRAM Throughput                   %        45.07
    Duration                         ms         1,752.74
    No Eligible                            %        35.62
    INF   FMA is the highest-utilized pipeline (56.7%) based on elapsed cycles
"""

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_math",'
          '"stall_wait","stall_math (Not Issued)"')


def _sass(name, rows):
    body = "\n".join(f'"0x{i:x}","{src}","0","{n}","{m}","{w}","99"' for i, (src, n, m, w) in enumerate(rows))
    return f'"Kernel Name","{name}",\n{HEADER}\n{body}\n'


def test_details_keeps_each_kernels_figures():
    k = parse_details(DETAILS)
    assert [x["kernel"][:28] for x in k] == ["void unnamed>::amax_vec_kern", "void unnamed>::quantize_tile"]
    assert k[0] == dict(kernel=k[0]["kernel"], dram_pct=83.04, us=135.01, ipc=2.92, issue_pct=71.05,
                        top_pipe="ALU", top_pipe_pct=64.7, registers=64.0, occupancy_pct=45.49)
    assert k[1]["us"] == pytest.approx(1752740) and k[1]["no_eligible_pct"] == 35.62 and k[1]["top_pipe"] == "FMA"
    assert "issue_pct" not in k[1]  # a metric the page leaves out is absent, not the kernel before's


def test_sass_counts_opcodes_the_alu_share_and_stalls():
    text = _sass("k0", [("LOP3.LUT R4, R30, 0x7fff7fff, RZ, 0xc0, !PT", 30, 3, 1),
                        ("@!P1  BRA 0x7fde5f7b6640", 10, 0, 2),
                        ("IMAD.U32 R29, R30, 0x10000, RZ", 40, 1, 0),
                        ("SHF.R.U32.HI R4, RZ, 0x10, R4", 20, 0, 1),
                        ("", 0, 0, 0)]) + _sass("k1", [("FFMA R5, R5, 4194307, R4", 8, 0, 0)])
    a, b = parse_sass(text)
    assert a["kernel"] == "k0" and a["instructions"] == 100
    assert a["opcodes"] == {"IMAD": 40, "LOP3": 30, "SHF": 20, "BRA": 10}
    assert a["alu_share"] == pytest.approx(0.5)  # LOP3 and SHF: the ALU pipe; IMAD runs on the FMA pipe
    assert a["stalls"] == {"math": pytest.approx(0.5), "wait": pytest.approx(0.5)}  # "Not Issued" columns left out
    assert b["kernel"] == "k1" and b["alu_share"] == 0.0 and b["stalls"] == {}
