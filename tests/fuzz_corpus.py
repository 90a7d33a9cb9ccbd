"""Token corpora shared by the fuzz tests (tests/test_fuzz.py) and the long run (bench/fuzz_long.py)."""

from variantgen.expr import TensorSig, Type, TypeEnv

YAML_TOKENS = [
    "name:", "mask:", "logits:", "tensors:", "scalars:", "scales:", "backends:", "description:", "dtype:",
    "shape:", "default:", "doc:", "sm_scale:", "qkv_scales:", "int", "float", "bool", "int32", "float32",
    "total_q", "total_kv", "batch", "num_qo_heads", "[", "]", "{", "}", ",", ":", "- ", "? ", " ", "  ", "\n",
    "\n  ", "\n    ", "\t", "#", "'", '"', "\\", "|", ">-", "|+", "&a ", "*a", "!!python/object:os.system ",
    "!!str ", "!x ", "<<: ", "---\n", "...\n", "%YAML 1.1\n", "kv_pos <= q_pos", "q_pos - kv_pos", " and ",
    " or ", "not ", "(", ")", "x", "causal", "params", "kv_len", "vg_x", "1", "-1", "0x1F", "1.5", "1e400",
    "9" * 60, ".nan", "true", "false", "null", "~", "2022-13-45", "é", "\u2028", "\x85", "\ufeff", "\x00",
    "\x07", "\ud800", "💥",
]
EXPR_TOKENS = [
    "kv_pos", "q_pos", "q_idx", "q_row", "kv_row", "request", "qo_head", "kv_head", "qo_len", "kv_len", "w", "f",
    "flag", "t", "s", "logits", "min", "max", "abs", "float", "tanh", "exp", "log", "sqrt", "sigmoid", "and", "or",
    "not", "if", "else", "true", "false", "(", ")", "[", "]", ",", "+", "-", "*", "/", "//", "%", "<", "<=", ">",
    ">=", "==", "!=", "=", "&&", "||", "!", "0", "1", "-1", "2147483647", "2147483648", "1.5", "1e39", "1e-45",
    ".5", "9" * 30, " ", "\n", "\t", "é", "٣", "\x00", "$", ";", "#", '"', "asm", "params", "x);", "@",
]
ENV = TypeEnv(
    scalars={"w": Type.INT, "f": Type.FLOAT, "flag": Type.BOOL},
    tensors={"t": TensorSig("t", 2, Type.INT), "s": TensorSig("s", 1, Type.FLOAT)},
    allow_logits=True,
)
NAMES = ["x", "causal", "params", "kv_len", "q_indptr", "int", "vg_x", "Abc", "../x", "a/b", "x\0", "x" * 60,
         'x); asm("trap");', "#include <x>", "sm_scale", "logits", "min", "and", "w", "f", "flag", "t", "s"]
