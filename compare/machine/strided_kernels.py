"""A unit-stride inner loop for MLX's strided CPU kernels: `python strided_kernels.py KERNEL.cpp` rewrites the file in
place, before the native g++ wrapper (environment.py mlx_cpu_jit) compiles it.

mx.compile fuses elementwise ops into C++ kernels. Where every input has the output's shape and layout, MLX writes a
flat loop, which g++ vectorises. Where one input is broadcast (a row's max subtracted from its logits, RMSNorm's
weight, RoPE's tables), it writes a "strided" kernel. Its innermost loop moves each pointer by a stride read from
memory at every element (`A += A_strides[1]`), and the output is written through another pointer that may alias
it. So g++ reloads the strides, cannot vectorise, and the loop runs scalar. On the Intel Xeon VM, the demo's logits
less their row max took 1.11 ms against 0.44 for a contiguous multiply of the same size. The fused exp with the
shift inside took 5.3 ms against 1.05 (docs/notes/2026-11-demo-gap.md).

The rewrite keeps the kernel's own loop and adds a faster one before it. In the common case every input's innermost
stride is 1 (it runs along the row) or 0 (broadcast along it). The inner loop then runs in chunks of CHUNK
elements, through `__restrict__` pointers with unit stride. A stride-0 input is read from a small buffer filled with
its value, so every operand is a plain array and g++ vectorises the body as it does a contiguous kernel's. The
arithmetic is the same statements in the same order, so the values are the same bits (tests/unit/test_strided_kernels.py
builds both and compares). A kernel this does not recognise is left as MLX wrote it.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

CHUNK = 256  # elements per inner chunk: each broadcast input's buffer is CHUNK values on the stack
MARK = "// dpcompare: unit-stride inner loop"

_INPUT = re.compile(r"^\s*(?P<type>[\w:]+)\* (?P<name>[A-Z]+) = \((?P=type)\*\)args\[\d+\];$")
_STRIDES = re.compile(r"^\s*const int64_t\* (?P<name>[A-Z]+)_strides = strides\[\d+\];$")
_FOR = re.compile(r"^\s*for \(int i(?P<dim>\d+) = 0; i(?P=dim) < shape\[(?P=dim)\]; \+\+i(?P=dim)\) \{$")
_LOAD = re.compile(r"^(?P<indent>\s*)(?P<type>[\w:]+) tmp_(?P<tmp>[A-Z]+) = \*(?P<name>[A-Z]+);$")
_STORE = re.compile(r"^(?P<indent>\s*)\*(?P<name>[A-Z]+)\+\+ = (?P<value>tmp_[A-Z]+);$")
_STEP = re.compile(r"^\s*(?P<name>[A-Z]+) \+= (?P=name)_strides\[(?P<dim>\d+)\];$")


def rewrite(source: str) -> str:
    """The kernel with the unit-stride loop added; `source` itself where it is not a strided kernel of the form
    MLX 0.32 writes, or was rewritten already."""
    if MARK in source or "_strided_" not in source:
        return source
    lines = source.split("\n")
    types: dict[str, str] = {}
    inputs: list[str] = []
    for i, line in enumerate(lines):
        match = _INPUT.match(line)
        if match:
            types[match["name"]] = match["type"]
            strides = _STRIDES.match(lines[i + 1]) if i + 1 < len(lines) else None
            if strides and strides["name"] == match["name"]:
                inputs.append(match["name"])
    loops = [i for i, line in enumerate(lines) if _FOR.match(line)]
    if not loops or not inputs:
        return source
    start = loops[-1]
    dim = _FOR.match(lines[start])["dim"]  # type: ignore[index]
    try:
        end = lines.index("  }", start)  # MLX closes each loop with two spaces and a brace
    except ValueError:
        return source
    body = lines[start + 1:end]
    steps = [_STEP.match(line) for line in body if _STEP.match(line)]
    if sorted(m["name"] for m in steps) != sorted(inputs) or any(m["dim"] != dim for m in steps):  # type: ignore[index]
        return source
    outputs = [m["name"] for m in (_STORE.match(line) for line in body) if m]
    if not outputs or any(name not in types or name in inputs for name in outputs):
        return source
    fast_body = []
    for line in body:
        if _STEP.match(line):
            continue
        load, store = _LOAD.match(line), _STORE.match(line)
        if load:
            if load["name"] not in inputs:
                return source
            fast_body.append(f"{load['indent']}{load['type']} tmp_{load['tmp']} = p{load['name']}_[j_];")
        elif store:
            fast_body.append(f"{store['indent']}p{store['name']}_[j_] = {store['value']};")
        elif "*" in line.replace("Multiply()", ""):  # any other pointer read: not a form this knows
            return source
        else:
            fast_body.append(line)
    n = f"shape[{dim}]"
    unit = " && ".join(f"({x}_strides[{dim}] == 0 || {x}_strides[{dim}] == 1)" for x in inputs)
    fast = [f"  {MARK}", f"  if ({unit}) {{"]
    for x in inputs:
        fast += [f"  {types[x]} {x}_buf_[{CHUNK}];",
                 f"  const bool {x}_broadcast_ = {x}_strides[{dim}] == 0;",
                 f"  if ({x}_broadcast_) {{ for (int j_ = 0; j_ < {CHUNK}; ++j_) {x}_buf_[j_] = *{x}; }}"]
    fast += [f"  for (int c_ = 0; c_ < {n}; c_ += {CHUNK}) {{",
             f"  const int m_ = {n} - c_ < {CHUNK} ? {n} - c_ : {CHUNK};"]
    fast += [f"  const {types[x]}* __restrict__ p{x}_ = {x}_broadcast_ ? {x}_buf_ : {x} + c_;" for x in inputs]
    fast += [f"  {types[y]}* __restrict__ p{y}_ = {y} + c_;" for y in outputs]
    fast += ["  for (int j_ = 0; j_ < m_; ++j_) {", *fast_body, "  }", "  }"]
    fast += [f"  {x} += {x}_strides[{dim}] * {n};" for x in inputs]
    fast += [f"  {y} += {n};" for y in outputs]
    fast += ["  } else {"]
    return "\n".join(lines[:start] + fast + lines[start:end + 1] + ["  }"] + lines[end + 1:])


def main(argv: list[str]) -> int:
    """Rewrite each .cpp argument in place, MLX's source kept beside it as KERNEL.cpp.orig: where g++ fails on the
    rewrite, the wrapper (environment.py mlx_cpu_jit) puts it back and builds it as MLX wrote it. Never fails."""
    for arg in argv:
        if arg.endswith(".cpp"):
            try:
                path = Path(arg)
                text = path.read_text()
                new = rewrite(text)
                if new != text:  # atomic: the ranks of one run may build the same kernel at once
                    for name, content in ((f"{path.name}.orig", text), (path.name, new)):
                        tmp = path.with_name(f"{name}.{os.getpid()}.tmp")
                        tmp.write_text(content)
                        os.replace(tmp, path.with_name(name))
            except Exception:  # noqa: BLE001 - MLX's own kernel is always a correct fallback
                continue
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
