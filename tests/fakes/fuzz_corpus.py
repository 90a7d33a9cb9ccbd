"""Token corpora shared by the fuzz tests (tests/cpu/test_fuzz.py) and the long run (bench/fuzz_long.py)."""

from variantgen.lang.expr import TensorSig, TypeEnv
from variantgen.lang.nodes import Type

YAML_TOKENS = [
    "name:", "mask:", "logits:", "sink:", "tensors:", "scalars:", "scales:", "backends:", "description:", "dtype:",
    "shape:", "default:", "doc:", "sm_scale:", "qkv_scales:", "min:", "max:", "positive:", "int", "float", "bool",
    "int32", "float32", "total_q", "total_kv", "batch", "num_qo_heads", "[", "]", "{", "}", ",", ":", "- ", "? ",
    " ", "  ", "\n", "\n  ", "\n    ", "\t", "#", "'", '"', "\\", "|", ">-", "|+", "&a ", "*a",
    "!!python/object:os.system ", "!!str ", "!x ", "<<: ", "---\n", "...\n", "%YAML 1.1\n", "kv_pos <= q_pos",
    "q_pos - kv_pos", " and ", " or ", "not ", "(", ")", "x", "causal", "params", "kv_len", "vg_x", "1", "-1",
    "0x1F", "1.5", "1e400", "9" * 60, "9" * 5000, "0x" + "F" * 4000, "1:2:3", ".nan", "true", "false", "null", "~",
    "2022-13-45", "é", "\u2028", "\x85", "\ufeff", "\x00", "\x07", "\ud800", "\\ud83d", "💥", "kv_row - 1",
    "doc[kv_pos]", "p[q_row]",
]
EXPR_TOKENS = [
    "kv_pos", "q_pos", "q_idx", "q_row", "kv_row", "q_kv_row", "request", "qo_head", "kv_head", "qo_len", "kv_len",
    "w", "f", "flag", "t", "s", "logits", "min", "max", "abs", "float", "tanh", "exp", "log", "sqrt", "sigmoid",
    "bit", "and", "or", "not", "if", "else", "true", "false", "(", ")", "[", "]", ",", "+", "-", "*", "/", "//", "%",
    "<", "<=", ">", ">=", "==", "!=", "=", "&&", "||", "!", "0", "1", "-1", "2147483647", "2147483648", "1.5", "1e39",
    "1e-45", ".5", "9" * 30, " ", "\n", "\t", "é", "٣", "\x00", "$", ";", "#", '"', "asm", "params", "x);", "@",
]
# t: [total_q, 2] int, s: [4] float (the tensors test_fuzz's generated specs declare).
ENV = TypeEnv(
    scalars={"w": Type.INT, "f": Type.FLOAT, "flag": Type.BOOL},
    tensors={"t": TensorSig("t", ("total_q", 2), Type.INT), "s": TensorSig("s", (4,), Type.FLOAT)},
    allow_logits=True,
)
NAMES = ["x", "causal", "params", "kv_len", "q_indptr", "int", "vg_x", "Abc", "../x", "a/b", "x\0", "x" * 60,
         'x); asm("trap");', "#include <x>", "sm_scale", "logits", "min", "and", "w", "f", "flag", "t", "s",
         "causal\n", "q\n", "\ud83d"]

CAUSAL = "name: x\nmask: kv_pos <= q_pos\n"
# Spec files that once broke the loader or misled a user (issue 14): each must fail with
# located, bounded, printable errors, never any other exception.
HOSTILE_SPECS = {
    "int over 4300 digits": CAUSAL + "scalars:\n  w: {dtype: int, default: " + "9" * 5000 + "}\n",
    "hex int over 4300 digits": CAUSAL + "scalars:\n  w: {dtype: int, default: 0x" + "F" * 4000 + "}\n",
    "base-60 int": CAUSAL + "tensors:\n  t: {dtype: int32, shape: [" + "59:" * 2000 + "1]}\n",
    "huge int as a shape and a range": CAUSAL + "tensors:\n  t: {dtype: int32, shape: [0o" + "7" * 5000 + "]}\n"
    "scalars:\n  w: {dtype: int, default: 1, max: " + "9" * 4400 + "}\n",
    "lone surrogate in the mask": 'name: x\nmask: "kv_pos <= q_pos and \\ud83d"\n',
    "lone surrogate in the name": 'name: "\\ud83d"\nmask: kv_pos <= q_pos\n',
    "lone surrogate in a key": CAUSAL + '"\\udcff": 1\n',
    "many bad keys on one line": "{name: x, mask: kv_pos <= q_pos, " + ", ".join(f"k{i}: 1" for i in range(8000))
    + "}\n",
    "many bad declarations": CAUSAL + "scalars:\n" + "".join(f"  s{i}: {{dtype: int, default: 1.5}}\n"
                                                             for i in range(3000)),
    "a 200 KB key": CAUSAL + "k" * 200_000 + ": 1\n",
    "a 4 KB unknown name": "name: x\nmask: " + "a" * 4000 + " > 0\n",
    "trailing newline in the name": 'name: "causal\\n"\nmask: kv_pos <= q_pos\n',
    "trailing newline in a tensor name": CAUSAL + 'tensors:\n  "q\\n": {dtype: int32, shape: [batch]}\n',
    "trailing newline in a scalar name": CAUSAL + 'scalars:\n  "q\\n": {dtype: int, default: 0}\n',
    "a key position on a key row dimension": "name: x\ntensors:\n  d: {dtype: int32, shape: [total_kv]}\n"
    "mask: d[kv_pos] > 0\n",
    "a per-request tensor read per query row": "name: x\ntensors:\n  p: {dtype: int32, shape: [batch]}\n"
    "mask: kv_pos <= max(q_pos, p[q_row] - 1)\n",
    "a batch-sized second dimension": CAUSAL + "tensors:\n  t: {dtype: int32, shape: [2, total_q]}\n",
    "a default outside its range": CAUSAL + "scalars:\n  w: {dtype: float, default: -1.0, positive: true}\n",
    "an unclosed list": CAUSAL + "backends: [fa2,\n",
}
