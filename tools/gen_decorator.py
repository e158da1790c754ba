#!/usr/bin/env python3
"""Writes src/distributed/decorator/ops_*.rs: the signatures of every op of Burn 0.21's backend
traits and of this crate's `Glm5Backend` (FloatTensorOps, IntTensorOps, BoolTensorOps, ModuleOps, ActivationOps, QTensorOps),
read from burn-backend's sources, as `forward!` lists that `Distributed<B>` delegates to `B` —
except `Glm5Backend`'s collectives (`INTERCEPTED`), which it runs itself (decorator/intercept.rs).

    python3 tools/gen_decorator.py ~/.cargo/registry/src/index.crates.io-*/burn-backend-0.21.0 [OUT_DIR]

(OUT_DIR defaults to src/distributed/decorator; `.ci/run` writes elsewhere and compares.)

Every method is listed, those with default bodies too: a defaulted op left out would run
Burn's generic default instead of `B`'s own implementation. Ops whose signatures carry
backend-generic structs (`TensorPrimitive<B>`, `MaxPool2dWithIndices<B>`, …) or the device
(`Distributed<B>`'s is `MeshDevice<B::Device>`) are written out with the conversions of
decorator/mod.rs (`convert::*_in` / `*_out`); `tr_execute` keeps its default body (its argument
has a private field), which reads through the forwarded `*_into_data` ops.
"""
import os
import re
import sys

TRAITS = {
    "FloatTensorOps": ("backend/ops/tensor.rs", "ops_float.rs"),
    "IntTensorOps": ("backend/ops/int_tensor.rs", "ops_int.rs"),
    "BoolTensorOps": ("backend/ops/bool_tensor.rs", "ops_bool.rs"),
    "ModuleOps": ("backend/ops/modules/base.rs", "ops_module.rs"),
    "ActivationOps": ("backend/ops/activation.rs", "ops_activation.rs"),
    "QTensorOps": ("backend/ops/qtensor.rs", "ops_quantized.rs"),
}
# `Glm5Backend`'s ops that `Distributed<B>` runs itself (decorator/intercept.rs): the collectives
INTERCEPTED = ("all_gather_rows", "reduce_scatter_rows", "all_to_all_rows", "all_reduce_sum", "shift_rows", "gather_param")
BY_HAND = ("Device<", "TensorPrimitive<", "MaxPool1dWithIndices<", "MaxPool2dWithIndices<", "MaxPool1dBackward<",
           "MaxPool2dBackward<", "DeformConv2dBackward<", "QuantizationParametersPrimitive<", "TransactionPrimitive<")


def methods(text, trait, header=None):
    i = text.index(header or f"pub trait {trait}<B: Backend>")
    k = text.index("{", i) + 1
    depth, out = 1, []
    while depth > 0:
        c = text[k]
        if depth == 1 and text.startswith("fn ", k) and text[k - 1] in " \n":
            m, par = k, 0
            while True:
                ch = text[m]
                par += ch in "(["
                par -= ch in ")]"
                if par == 0 and ch in ";{":
                    break
                m += 1
            sig = " ".join(text[k:m].split()).replace("( ", "(").replace(", )", ")")
            out.append(sig.replace("crate::tensor::", ""))  # paths inside burn-backend; imported in mod.rs
            k = m
            continue
        depth += c == "{"
        depth -= c == "}"
        k += 1
    return out


# backend-generic structs: how a value crosses between `Distributed<B>` and `B`
CONVERT = {"Device": "device", "TensorPrimitive": "primitive", "QuantizationParametersPrimitive": "qparams", "MaxPool1dWithIndices": "pool1d",
           "MaxPool2dWithIndices": "pool2d", "MaxPool1dBackward": "pool1d_grad", "MaxPool2dBackward": "pool2d_grad",
           "DeformConv2dBackward": "deform_grad"}


def split_args(args_text):
    """A signature's arguments, split at the top-level commas."""
    args, depth, cur = [], 0, ""
    for ch in args_text:
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        args.append(cur.strip())
    return args


def explicit(sig):
    """A forwarding method whose arguments or result need `convert::*_in` / `convert::*_out`."""
    name = re.match(r"fn (\w+)\(", sig).group(1)
    args = split_args(sig[sig.index("(") + 1:sig.rindex(")")])
    call = []
    for a in args:
        arg, ty = a.split(":", 1)
        kind = next((v for k, v in CONVERT.items() if ty.strip().lstrip("&").startswith(k + "<")), None)
        call.append(f"convert::{kind}_in({arg.strip()})" if kind else arg.strip())
    ret = sig.rsplit("->", 1)[1].strip()
    kind = next((v for k, v in CONVERT.items() if ret.startswith(k + "<")), None)
    body = f"B::{name}({', '.join(call)})"
    body = f"convert::{kind}_out({body})" if kind else body
    return f"\n    {re.sub(r'[(]', '(', re.sub(chr(92) + 'bB' + chr(92) + 'b', 'Self', sig))} {{\n        {body}\n    }}\n"


def main():
    root = os.path.join(os.path.expanduser(sys.argv[1]), "src")
    default_out = os.path.join(os.path.dirname(__file__), "..", "src", "distributed", "decorator")
    out_dir = sys.argv[2] if len(sys.argv) > 2 else default_out
    for trait, (src, dst) in TRAITS.items():
        sigs = methods(open(os.path.join(root, src)).read(), trait)
        plain = [sig for sig in sigs if not any(t in sig for t in BY_HAND)]
        converted = [sig for sig in sigs if any(t in sig for t in BY_HAND) and "TransactionPrimitive<" not in sig]
        lines = "".join("            " + re.sub(r"\bB\b", "Self", sig) + ";\n" for sig in plain)
        rs = (f"//! `{trait}` of `Distributed<B>`: all {len(sigs)} ops forwarded to `B`"
              f"{f' ({len(converted)} through the result/argument conversions of `mod.rs`)' if converted else ''}.\n"
              f"//! Generated by `tools/gen_decorator.py` from burn-backend 0.21.0; do not edit.\n\n"
              f"use super::*;\n\nimpl<B: Backend> {trait}<Self> for Distributed<B> {{\n"
              f"    forward! {{\n{lines}    }}\n" + "".join(explicit(sig) for sig in converted) + "}\n")
        open(os.path.join(out_dir, dst), "w").write(rs)
        print(f"{dst}: {len(sigs)} {trait} ops, {len(converted)} converted")

    # this crate's own op trait: every method, so the decorated backend keeps B's kernels and
    # fused bodies (a method left out would silently run the reference default); the
    # collectives are intercepted: run by `decorator/intercept.rs`, not forwarded
    ours = os.path.join(os.path.dirname(__file__), "..", "src", "ops", "backend", "mod.rs")
    sigs = methods(open(ours).read(), "Glm5Backend", "pub trait Glm5Backend: burn::tensor::backend::Backend")
    name = lambda sig: re.match(r"fn (\w+)\(", sig).group(1)
    missing = [op for op in INTERCEPTED if op not in map(name, sigs)]
    if missing:
        sys.exit(f"gen_decorator: intercepted ops not in Glm5Backend: {missing}")
    forwarded = [sig for sig in sigs if name(sig) not in INTERCEPTED]
    lines = "".join("            " + sig + ";\n" for sig in forwarded)

    def intercept(sig):
        args = [a.split(":")[0].strip() for a in split_args(sig[sig.index("(") + 1:sig.rindex(")")])]
        return f"\n    {sig} {{\n        intercept::{name(sig)}::<B>({', '.join(args)})\n    }}\n"

    rs = (f"//! `Glm5Backend` of `Distributed<B>`: {len(forwarded)} ops forwarded to `B`, the `*_impl()` queries\n"
          f"//! included (so `B`'s kernels and fused bodies stay in use), and the {len(INTERCEPTED)} collectives run\n"
          f"//! by `intercept.rs`. Generated by `tools/gen_decorator.py` from `src/ops/backend/mod.rs`;\n"
          f"//! do not edit.\n\n"
          f"use super::*;\n\nimpl<B: Glm5Backend> Glm5Backend for Distributed<B> {{\n    forward! {{\n{lines}    }}\n"
          + "".join(intercept(sig) for sig in sigs if name(sig) in INTERCEPTED) + "}\n")
    open(os.path.join(out_dir, "ops_glm5.rs"), "w").write(rs)
    print(f"ops_glm5.rs: {len(forwarded)} Glm5Backend ops forwarded, {len(INTERCEPTED)} intercepted")


if __name__ == "__main__":
    main()
