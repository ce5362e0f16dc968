"""The quantize kernels' hardware counters: why a kernel runs at the speed benchmarks/quantize.py measures.

For each named case of quantize.py (16384x16384 bf16 by default), Nsight Compute (`ncu`, which reads the GPU's
counters where the machine lets it) profiles the case's kernels in a run of quantize.py (the jaxhq amax and
quantize launches, after their warm-up calls) with clocks left as they are. Per kernel it prints: the duration,
DRAM throughput and issue-slot use (percent of peak), achieved occupancy, registers, the pipeline ncu names as the
most used and its utilization, the instructions executed per element of x (warp instructions times 32: the issue
cost, both copies), the share of those on the integer/logic pipeline (the opcodes NVIDIA's documentation assigns
to the ALU pipe, from the executed SASS), the warps' stall reasons (percent of samples), and the most executed
opcodes. A kernel whose issue slots and ALU pipe are both near their peak while DRAM is not runs as fast as its
instruction count allows; one near DRAM's peak is bound by its bytes. Writes JSON (--out).

    python benchmarks/kernel_counters.py --cases nvfp4,mxfp8 [--m 16384 --k 16384]
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The details page's metrics kept per kernel (name as ncu prints it -> key); the duration's units to microseconds
DETAILS = {"Duration": "us", "DRAM Throughput": "dram_pct", "Issue Slots Busy": "issue_pct",
           "Achieved Occupancy": "occupancy_pct", "Registers Per Thread": "registers",
           "Executed Ipc Active": "ipc", "No Eligible": "no_eligible_pct"}
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
# Integer and logic opcodes: the ALU pipe (IMAD / IMUL run on the FMA pipe; FP32 min/max, compares and selects,
# shifts, LEA, LOP3, PRMT and integer adds and compares on the ALU)
ALU = {"LOP3", "SHF", "LEA", "IADD3", "VIADD", "VIMNMX", "VIMNMX3", "IMNMX", "FMNMX", "ISETP", "FSETP", "FSEL",
       "SEL", "PRMT", "PLOP3", "P2R", "R2P", "BMSK", "FLO", "POPC", "BREV", "SGXT", "IABS", "LOP", "FSET", "ISET"}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_details(text: str) -> list:
    """Kernels of ncu's details page (text), in order: {kernel, DETAILS' keys, top_pipe, top_pipe_pct}."""
    kernels, cur = [], None
    for line in text.splitlines():
        head = re.match(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context", line)
        if head:
            cur = {"kernel": head.group(1)}
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.match(r"^\s{4}(\S.*?)\s{2,}(?:(\S+)\s+)?([\d,]+(?:\.\d+)?)\s*$", line)
        if m and m.group(1) in DETAILS and DETAILS[m.group(1)] not in cur:
            cur[DETAILS[m.group(1)]] = _number(m.group(3)) * (TO_US.get(m.group(2), 1.0) if m.group(1) == "Duration"
                                                               else 1.0)
        pipe = re.search(r"(\w[\w ]*?) is the highest-utilized pipeline \(([\d.]+)%\)", line)
        if pipe and "top_pipe" not in cur:
            cur["top_pipe"], cur["top_pipe_pct"] = pipe.group(1).split()[-1], float(pipe.group(2))
    return kernels


def parse_sass(text: str) -> list:
    """Kernels of ncu's source page (CSV, SASS), in order: {kernel, instructions (warp instructions executed),
    alu_share, opcodes ({opcode: warp instructions}), stalls ({reason: share of samples})}."""
    out = []
    for part in text.split('"Kernel Name"')[1:]:
        lines = part.splitlines()
        name = lines[0].strip(",").strip('"')
        rows = csv.DictReader(io.StringIO("\n".join(lines[1:])))
        ops, stalls = collections.Counter(), collections.Counter()
        for r in rows:
            words = (r.get("Source") or "").split()
            if words and words[0].startswith("@"):
                words = words[1:]
            n = int(r.get("Instructions Executed") or 0)
            if words and n:
                ops[words[0].split(".")[0]] += n
            for k, v in r.items():
                if k and k.startswith("stall_") and "Not Issued" not in k and v:
                    stalls[k[6:]] += int(v)
        total, samples = sum(ops.values()), sum(stalls.values())
        out.append(dict(kernel=name, instructions=total,
                        alu_share=sum(v for k, v in ops.items() if k in ALU) / total if total else 0.0,
                        opcodes=dict(ops.most_common()),
                        stalls={k: v / samples for k, v in stalls.most_common()} if samples else {}))
    return out


def _ncu() -> str:
    for c in (shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if c and os.path.exists(c):
            return c
    raise SystemExit("ncu (Nsight Compute) not found")


def profile(case: str, m: int, k: int, ncu: str, skip: int, count: int) -> list:
    """The case's kernels profiled in one run of quantize.py: details and SASS merged per kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "r")
        cmd = [ncu, "--clock-control", "none", "--set", "full", "-k", "regex:quantize|amax", "--launch-skip",
               str(skip), "--launch-count", str(count), "-o", rep, sys.executable, os.path.join(HERE, "quantize.py"),
               "--no-xla", "--cases", case, "--m", str(m), "--k", str(k), "--out", os.path.join(tmp, "q.json")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode or not os.path.exists(rep + ".ncu-rep"):
            raise SystemExit(f"ncu failed for {case}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        page = lambda *a: subprocess.run([ncu, "--import", rep + ".ncu-rep", *a], capture_output=True, text=True,
                                         check=True).stdout
        details = parse_details(page("--page", "details"))
        sass = parse_sass(page("--page", "source", "--csv", "--print-source", "sass"))
    if len(sass) == 2 * len(details):  # ncu 2025.3's source page lists each profiled launch twice
        sass = sass[::2]
    rows = []
    for d, s in zip(details, sass):
        per_el = 32 * s["instructions"] / (m * k)  # a warp instruction for each of its 32 lanes
        rows.append(dict(case=case, **d, instr_per_element=per_el, alu_share=s["alu_share"],
                         stalls=s["stalls"], opcodes=s["opcodes"]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="nvfp4,nvfp4_rht_sr_dec,mxfp8", help="quantize.py case names, comma-separated")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=16384)
    p.add_argument("--skip", type=int, default=2, help="matching launches left unprofiled first (the warm-up calls)")
    p.add_argument("--count", type=int, default=2, help="launches profiled per case")
    p.add_argument("--out", default="kernel_counters.json")
    a = p.parse_args()
    ncu, rows = _ncu(), []
    for case in a.cases.split(","):
        for r in profile(case, a.m, a.k, ncu, a.skip, a.count):
            rows.append(r)
            ops = sorted(r["opcodes"].items(), key=lambda kv: -kv[1])[:6]
            total = sum(r["opcodes"].values()) or 1
            print(f"{case:22s} {r['kernel'][:70]}\n"
                  f"  {r.get('us', float('nan')):8.1f} us  DRAM {r.get('dram_pct', 0):5.1f}%  issue "
                  f"{r.get('issue_pct', 0):5.1f}%  {r.get('top_pipe', '?')} {r.get('top_pipe_pct', 0):5.1f}%  "
                  f"occupancy {r.get('occupancy_pct', 0):5.1f}%  {r.get('registers', 0):.0f} regs  "
                  f"{r['instr_per_element']:.1f} instructions/element  ALU-class {100 * r['alu_share']:.1f}%\n"
                  f"  opcodes: {', '.join(f'{o} {100 * n / total:.1f}%' for o, n in ops)}\n"
                  f"  stalls: {', '.join(f'{s} {100 * v:.1f}%' for s, v in list(r['stalls'].items())[:6])}",
                  flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(shape=[a.m, a.k], rows=rows), f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
