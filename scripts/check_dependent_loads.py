#!/usr/bin/env python3
"""Fails when a chained kernel may read a previous grid's output non-coherently.

A kernel launched with cuda::launch_dependent (programmatic dependent launch)
runs while the grid before it in the stream still writes. Non-coherent loads
(`__ldg`, `ld.global.nc`, or loads the compiler derives from a
`const T* __restrict__` parameter; `LDG...CONSTANT` in SASS) are valid only
for data no grid writes during the kernel's lifetime: griddepcontrol.wait
does not make them safe. docs/ARCHITECTURE.md, "Chained kernels", states the
rule; this script checks it on the built SASS.

For every kernel that executes griddepcontrol.wait (`ACQBULK` in SASS), every
non-coherent global load must take its address from kernel parameters typed
`lowbit::cuda::ReadOnly<T>` (module state: weights, scales, bias) and from no
other pointer. The address registers are traced back, through every
instruction that may have written them (flow-insensitive, so an
over-approximation), to the parameter words (`c[0x0][...]`) they derive from;
each word is mapped to its parameter through the kernel's EIATTR_KPARAM_INFO
and classified by the parameter's type in the demangled signature:

  ReadOnly<T>            may be loaded non-coherently;
  arithmetic scalar      an index or size, ignored;
  known pointer-free     ignored (POINTER_FREE_TYPES);
  anything else          a pointer (or a struct that may hold one): forbidden.

An address derived from no parameter at all (e.g. a pointer loaded from
memory) is reported too: its source cannot be shown to be module state.

usage: check_dependent_loads.py [--cuobjdump PATH] FILE...   (objects, .a, .so, .cubin)
       check_dependent_loads.py --sass F.sass --elf F.elf      (saved cuobjdump output)
Exit status 0: no violation; 1: violations (listed); 2: could not check.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys

READONLY_TYPE = "lowbit::cuda::ReadOnly<"

SCALAR_TYPES = {
    "bool", "char", "signed char", "unsigned char", "short", "unsigned short", "int", "unsigned int", "long",
    "unsigned long", "long long", "unsigned long long", "float", "double", "__half", "__nv_bfloat16",
}

# By-value structs and enums known to hold no pointer: their words are sizes,
# counts and options. A struct that holds a pointer does not belong here.
POINTER_FREE_TYPES = {
    "lowbit::routing::(anonymous namespace)::Params",
    "lowbit::routing::ScoreFunc",
    "lowbit::routing::HashWeighting",
    "lowbit::nvfp4::gemm::(anonymous namespace)::StreamKRuns",
}

# By-value structs whose pointers all lie in their first N bytes (the words
# after are counts and sizes). The struct's definition asserts the layout.
POINTERS_FIRST = {
    "lowbit::nvfp4::moe::(anonymous namespace)::WorkList": 24,
}

WAIT_OPCODE = "ACQBULK"  # griddepcontrol.wait
REG_RE = re.compile(r"\b(U?R)(\d+)(\.64)?")
CBANK_RE = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+|R\d+[^\]]*|UR\d+[^\]]*)\]")
MEM = "mem"  # taint of a value loaded from memory


@dataclasses.dataclass
class Param:
    ordinal: int
    offset: int  # absolute, in constant bank 0
    size: int
    type: str
    kind: str  # "readonly" | "scalar" | "pointer"


@dataclasses.dataclass
class Violation:
    kernel: str
    address: str
    instruction: str
    params: list[str]

    def __str__(self) -> str:
        why = ", ".join(self.params) if self.params else "an address derived from no kernel parameter"
        return f"{self.kernel}\n    /*{self.address}*/ {self.instruction}\n    reads through: {why}"


# ---- signatures -------------------------------------------------------------------


def split_params(demangled: str) -> list[str]:
    """The parameter types of a demangled function name."""
    s = demangled.strip()
    if not s.endswith(")"):
        return []
    depth, i = 0, len(s) - 1
    while i >= 0:
        if s[i] == ")":
            depth += 1
        elif s[i] == "(":
            depth -= 1
            if depth == 0:
                break
        i -= 1
    return [p for p in split_top_level(s[i + 1 : -1], "<([", ">)]") if p != "void"]


def split_top_level(s: str, opens: str, closes: str) -> list[str]:
    """s split at the commas outside any bracket of `opens` / `closes`."""
    out, cur, depth = [], "", 0
    for ch in s:
        if ch in opens:
            depth += 1
        elif ch in closes:
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def classify(t: str) -> str:
    t = t.strip()
    if t.startswith(READONLY_TYPE):
        return "readonly"
    base = re.sub(r"\bconst\b|\bvolatile\b", "", t).strip()
    base = re.sub(r"\s+", " ", base)
    if base.endswith("*") or base.endswith("&"):
        return "pointer"
    if base in SCALAR_TYPES or base in POINTER_FREE_TYPES:
        return "scalar"
    return "pointer"


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    res = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    return {n: (d if d else n) for n, d in zip(names, lines)}


# ---- cuobjdump output ---------------------------------------------------------------


def parse_sass(text: str) -> dict[str, list[tuple[str, str]]]:
    """Kernel (mangled) -> [(address, instruction)] from `cuobjdump -sass`."""
    funcs: dict[str, list[tuple[str, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((m.group(1), m.group(2)))
    return funcs


def parse_elf(text: str) -> dict[str, dict]:
    """Kernel (mangled) -> {"base": param bank offset, "params": {ordinal: (offset, size)}} from `cuobjdump -elf`."""
    info: dict[str, dict] = {}
    cur = None
    attr = None
    for line in text.splitlines():
        m = re.match(r"\.nv\.info\.(\S+)\s*$", line.strip())
        if m:
            cur = info.setdefault(m.group(1), {"base": 0x210, "params": {}})
            continue
        if cur is None:
            continue
        m = re.match(r"\s*Attribute:\s*(\S+)", line)
        if m:
            attr = m.group(1)
            continue
        if attr == "EIATTR_KPARAM_INFO":
            m = re.search(r"Ordinal : (0x[0-9a-f]+)\s+Offset\s*: (0x[0-9a-f]+)\s+Size\s*: (0x[0-9a-f]+)", line)
            if m:
                cur["params"][int(m.group(1), 16)] = (int(m.group(2), 16), int(m.group(3), 16))
        elif attr == "EIATTR_PARAM_CBANK":
            m = re.search(r"Value:\s*0x[0-9a-f]+\s+(0x[0-9a-f]+)", line)
            if m:
                cur["base"] = int(m.group(1), 16) & 0xFFFF
        if line.strip() == "" or line.startswith("."):
            attr = attr if line.strip() == "" else None
    return info


# ---- dataflow -------------------------------------------------------------------------




def decode(ins: str) -> tuple[str, list[str]]:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins.strip())
    parts = ins.split(None, 1)
    return parts[0], split_top_level(parts[1], "[", "]") if len(parts) > 1 else []


def regs_of(operand: str, width: int) -> list[str]:
    """Registers an operand reads, `width` 32-bit registers each (a memory
    descriptor `desc[URn]` excluded; `Rn.64` is a pair whatever the width)."""
    operand = re.sub(r"desc\[[^\]]*\]", "", operand)
    out = []
    for kind, num, wide in REG_RE.findall(operand):
        n = int(num)
        out += [f"{kind}{n + i}" for i in range(max(width, 2 if wide else 1))]
    return out


def cbank_words(operand: str, width: int, all_words: set[int]) -> set[int]:
    words: set[int] = set()
    for m in CBANK_RE.finditer(operand):
        v = m.group(1)
        if not v.startswith("0x"):
            return set(all_words)  # indexed parameter access: any word
        off = int(v, 16) & ~3
        words.update(off + 4 * i for i in range(width))
    return words


def op_width(op: str) -> int:
    """32-bit registers per operand of an instruction (.WIDE: see operand_widths)."""
    if ".128" in op:
        return 4
    if ".64" in op:
        return 2
    return 1


def operand_widths(op: str, n: int) -> list[int]:
    """Widths of an instruction's n operands, destination first."""
    if ".WIDE" in op:  # IMAD.WIDE d, a, b, c: d and c 64-bit
        return [2] + [2 if i == 3 else 1 for i in range(1, n)]
    w = op_width(op)
    return [w] * n


NO_DST = ("ST", "RED", "ATOM", "BRA", "BAR", "EXIT", "RET", "CALL", "SYNCS", "UTMA", "UBLKCP", "MEMBAR", "FENCE",
          "WARPSYNC", "BSSY", "BSYNC", "NOP", "ERRBAR", "CCTL", "LDGSTS", "LDGDEPBAR", "DEPBAR", "ACQBULK", "PREEXIT")
MEMORY_LOADS = ("LDG", "LDS", "LDL", "LDSM", "LD.", "ATOM", "SHFL")


def transfer_of(op: str, ops: list[str], all_words: set[int]):
    """(destinations, source registers, parameter words) of an instruction, or None when it writes no register."""
    if not ops or op.startswith(NO_DST) or not REG_RE.match(ops[0]):
        return None
    widths = operand_widths(op, len(ops))
    m = REG_RE.match(ops[0])
    kind, num = m.group(1), int(m.group(2))
    dsts = [f"{kind}{num + i}" for i in range(widths[0])]
    srcs: list[str] = []
    words: set = set()
    if op.startswith(MEMORY_LOADS) or op == "LD":
        words.add(MEM)  # a value from memory: data, not a parameter
    else:
        for o, w in zip(ops[1:], widths[1:]):
            srcs += regs_of(o, w)
            words |= cbank_words(o, w, all_words)
    return dsts, srcs, frozenset(words)


BRANCH_RE = re.compile(r"\b(0x[0-9a-f]+)\s*$")


def analyze(instrs: list[tuple[str, str]], all_words: set[int], wanted) -> dict[int, dict]:
    """Forward dataflow over the kernel's control flow: for each instruction
    index i with wanted(i), the parameter words (and MEM) that each register
    may derive from just before it. A predicated write joins the old value."""
    n = len(instrs)
    index = {int(a, 16): i for i, (a, _) in enumerate(instrs)}
    dec = []
    for _, ins in instrs:
        pred = bool(re.match(r"^@!?U?P", ins.strip())) and not ins.strip().startswith("@PT ")
        op, ops = decode(ins)
        dec.append((pred, op, ops, transfer_of(op, ops, all_words)))
    call_returns = [i + 1 for i, d in enumerate(dec) if d[1].startswith("CALL") and i + 1 < n]
    succ: list[list[int]] = []
    for i, (pred, op, ops, _) in enumerate(dec):
        nxt = [i + 1] if i + 1 < n else []
        if op.startswith(("BRA", "CALL")):
            m = BRANCH_RE.search(ops[-1]) if ops else None
            tgt = [index[int(m.group(1), 16)]] if m and int(m.group(1), 16) in index else list(range(n))
            cond = pred or ".DIV" in op or op.startswith("CALL")
            succ.append(tgt + (nxt if cond else []))
        elif op.startswith(("BRX", "JMX")):
            succ.append(list(range(n)))
        elif op.startswith("RET"):
            succ.append(call_returns + (nxt if pred else []))
        elif op.startswith("EXIT"):
            succ.append(nxt if pred else [])
        else:
            succ.append(nxt)
    leader = [False] * (n + 1)
    leader[0] = True
    for i, nx in enumerate(succ):
        if nx != [i + 1]:
            for j in nx:
                leader[j] = True
    states: dict[int, dict] = {0: {}}
    work = [0]
    out: dict[int, dict] = {}
    while work:
        i = work.pop()
        state = dict(states[i])
        while True:
            if wanted(i):
                out[i] = dict(state)
            pred, op, ops, tr = dec[i]
            if tr:
                dsts, srcs, words = tr
                t = set(words)
                for r in srcs:
                    t |= state.get(r, frozenset())
                t = frozenset(t)
                for d in dsts:
                    state[d] = (state.get(d, frozenset()) | t) if pred else t
            nx = succ[i]
            if len(nx) == 1 and nx[0] == i + 1 and not leader[i + 1]:
                i += 1
                continue
            for j in nx:
                old = states.get(j)
                if old is None:
                    states[j] = dict(state)
                    work.append(j)
                    continue
                merged, grew = old, False
                for r, t in state.items():
                    o = old.get(r)
                    if o is None or not t <= o:
                        if not grew:
                            merged, grew = dict(old), True
                        merged[r] = t if o is None else o | t
                if grew:
                    states[j] = merged
                    work.append(j)
            break
    return out


def param_of(word: int, params: list[Param]) -> Param | None:
    for p in params:
        if p.offset <= word < p.offset + max(p.size, 4):
            return p
    return None


def check_kernel(name: str, demangled: str, instrs, elf: dict | None) -> list[Violation]:
    if not any(decode(ins)[0] == WAIT_OPCODE for _, ins in instrs):
        return []
    types = split_params(demangled)
    params: list[Param] = []
    if elf:
        for ordinal, (off, size) in sorted(elf["params"].items()):
            t = types[ordinal] if ordinal < len(types) else "?"
            params.append(Param(ordinal, elf["base"] + off, size, t, classify(t)))
    all_words = {p.offset + i for p in params for i in range(0, max(p.size, 4), 4)}
    loads = set()
    for i, (_, ins) in enumerate(instrs):
        op, ops = decode(ins)
        if op.startswith(("LDG", "LD.")) and ".CONSTANT" in op and len(ops) >= 2:
            loads.add(i)
    if not loads:
        return []
    states = analyze(instrs, all_words, loads.__contains__)
    out = []
    for i in sorted(loads):
        addr, ins = instrs[i]
        op, ops = decode(ins)
        if i not in states:
            continue  # unreachable
        taint = states[i]
        t: set = set()
        for r in regs_of(ops[1], 1):
            t |= taint.get(r, set())
        t |= cbank_words(ops[1], 1, all_words)
        bad, any_param = [], False
        for w in sorted(x for x in t if x != MEM):
            p = param_of(w, params)
            if p is None:
                continue  # not a parameter (launch constants such as blockDim)
            any_param = True
            if p.kind == "pointer" and w - p.offset < POINTERS_FIRST.get(p.type.replace("const ", "").strip(), 1 << 30):
                label = f"parameter {p.ordinal} ({p.type})"
                if label not in bad:
                    bad.append(label)
        if bad or not any_param:
            out.append(Violation(demangled, addr, ins, bad))
    return out


def check(sass_text: str, elf_text: str) -> tuple[int, list[Violation]]:
    funcs = parse_sass(sass_text)
    elf = parse_elf(elf_text)
    names = demangle(list(funcs))
    violations: list[Violation] = []
    dependent = 0
    for name, instrs in funcs.items():
        if any(decode(ins)[0] == WAIT_OPCODE for _, ins in instrs):
            dependent += 1
            violations += check_kernel(name, names[name], instrs, elf.get(name))
    return dependent, violations


def find_cuobjdump(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    tool = shutil.which("cuobjdump")
    if tool:
        return tool
    for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if d and os.access(os.path.join(d, "bin", "cuobjdump"), os.X_OK):
            return os.path.join(d, "bin", "cuobjdump")
    spec = importlib.util.find_spec("triton")  # torch's triton ships one
    if spec and spec.submodule_search_locations:
        cand = os.path.join(list(spec.submodule_search_locations)[0], "backends", "nvidia", "bin", "cuobjdump")
        if os.access(cand, os.X_OK):
            return cand
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="object files, static or shared libraries, cubins")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--sass", help="saved `cuobjdump -sass` output")
    ap.add_argument("--elf", help="saved `cuobjdump -elf` output")
    args = ap.parse_args(argv)
    sass, elf = "", ""
    if args.sass:
        sass = open(args.sass).read()
        elf = open(args.elf).read() if args.elf else ""
    if args.files:
        tool = find_cuobjdump(args.cuobjdump)
        if not tool:
            print("check_dependent_loads: cuobjdump not found", file=sys.stderr)
            return 2
        for f in args.files:
            for flag in ("-sass", "-elf"):
                r = subprocess.run([tool, flag, f], capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"check_dependent_loads: {tool} {flag} {f} failed:\n{r.stderr}", file=sys.stderr)
                    return 2
                if flag == "-sass":
                    sass += r.stdout
                else:
                    elf += r.stdout
    if not sass:
        ap.error("nothing to check")
    dependent, violations = check(sass, elf)
    if dependent == 0:
        print("check_dependent_loads: no kernel executes griddepcontrol.wait; nothing checked", file=sys.stderr)
        return 2
    for v in violations:
        print(v)
    kernels = len({v.kernel for v in violations})
    print(f"check_dependent_loads: {dependent} dependent kernels, {len(violations)} non-coherent loads of "
          f"previous-grid data in {kernels} of them")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
