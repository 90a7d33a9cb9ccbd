"""Names a spec argument may not take because of the C++ it becomes.

Each argument becomes a field of a params struct (``params.<name>``), a kernel parameter
``vg_arg_<name>`` and a local ``arg_<name>``. A name the preprocessor or the compiler already
gives a meaning breaks that code (``errno`` expands to ``(*__errno_location ())``, ``linux``
to ``1``) or, for a function-like macro, breaks it as soon as a use is followed by ``(``.
The classes below say why each name is refused; ``reserved_reason`` gives the message.
spec.py keeps the names tied to FlashInfer's kernels and to the wrappers (RESERVED_NAMES,
WRAPPER_PARAMS) and the C++ keywords (CPP_KEYWORDS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NameClass:
    key: str
    why: str  # completes "`name` is ..."
    names: frozenset[str]
    # One name of the class and whether it breaks the generated code's use of an argument name
    # with the host compiler today (tests/cpu/test_reserved.py compiles it); the others are
    # refused because another C library, compiler or CUDA version may define them so.
    example: str
    breaks_today: bool


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


LIBRARY_MACROS = NameClass(
    "library_macro",
    "a macro of the C/C++ standard library, which the generated code's headers define",
    _words("""errno math_errhandling stdin stdout stderr complex imaginary noreturn
    NULL EOF WEOF BUFSIZ FILENAME_MAX FOPEN_MAX TMP_MAX L_tmpnam SEEK_SET SEEK_CUR SEEK_END
    INFINITY NAN HUGE_VAL HUGE_VALF HUGE_VALL FP_NAN FP_INFINITE FP_ZERO FP_NORMAL FP_SUBNORMAL
    FP_ILOGB0 FP_ILOGBNAN MATH_ERRNO MATH_ERREXCEPT M_E M_LOG2E M_LOG10E M_LN2 M_LN10 M_PI M_PI_2
    M_PI_4 M_1_PI M_2_PI M_2_SQRTPI M_SQRT2 M_SQRT1_2 FLT_MAX FLT_MIN FLT_EPSILON FLT_DIG
    FLT_MANT_DIG FLT_RADIX DBL_MAX DBL_MIN DBL_EPSILON DBL_DIG LDBL_MAX CHAR_BIT CHAR_MAX CHAR_MIN
    SCHAR_MAX SCHAR_MIN UCHAR_MAX SHRT_MAX SHRT_MIN USHRT_MAX INT_MAX INT_MIN UINT_MAX LONG_MAX
    LONG_MIN ULONG_MAX LLONG_MAX LLONG_MIN ULLONG_MAX INT8_MAX INT16_MAX INT32_MAX INT64_MAX
    INT8_MIN INT16_MIN INT32_MIN INT64_MIN UINT8_MAX UINT16_MAX UINT32_MAX UINT64_MAX SIZE_MAX
    PTRDIFF_MAX INTPTR_MAX UINTPTR_MAX RAND_MAX EXIT_SUCCESS EXIT_FAILURE MB_CUR_MAX MB_LEN_MAX
    CLOCKS_PER_SEC EDOM ERANGE EILSEQ SIGINT SIGTERM SIGSEGV SIGABRT SIGFPE SIGILL SIG_DFL SIG_IGN
    SIG_ERR LC_ALL LC_NUMERIC CHAR16_MAX"""),
    "errno", True)

FUNCTION_MACROS = NameClass(
    "function_macro",
    "a function-like macro of the C/C++ standard library: any use followed by '(' is expanded",
    _words("""assert offsetof setjmp va_arg va_start va_end va_copy fpclassify isfinite isinf isnan
    isnormal signbit isgreater isgreaterequal isless islessequal islessgreater isunordered getc putc
    getchar putchar INT8_C INT16_C INT32_C INT64_C UINT8_C UINT16_C UINT32_C UINT64_C INTMAX_C
    UINTMAX_C"""),
    "assert", False)

PREDEFINED_MACROS = NameClass(
    "predefined_macro",
    "a macro the host compiler predefines (GNU dialects, which nvcc's host compiler uses)",
    _words("linux unix i386 sun sparc mips vax"),
    "linux", True)

CUDA_BUILTINS = NameClass(
    "cuda_builtin",
    "a CUDA built-in variable or type of every kernel",
    _words("""threadIdx blockIdx blockDim gridDim warpSize clusterIdx clusterDim dim3""")
    | frozenset(f"{base}{n}" for base in ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong",
                                         "longlong", "ulonglong", "float", "double") for n in range(1, 5)),
    "warpSize", False)

# The generated code's own locals and members (q_pos_base, pack_gqa, ...) are not reserved: every
# argument reaches the C++ under a prefixed name (vg_arg_<name>), which
# tests/cpu/test_build_nvcc.py::test_argument_names_never_meet_the_generated_codes_own compiles.

CLASSES = (LIBRARY_MACROS, FUNCTION_MACROS, PREDEFINED_MACROS, CUDA_BUILTINS)

# Reserved to the implementation by the C and C++ standards: any name with a double underscore,
# and names that start with an underscore (followed by a capital, or anywhere at global scope).
RESERVED_PATTERN = re.compile(r".*__.*|_.*")
RESERVED_PATTERN_EXAMPLE = "__cplusplus"  # (a name so reserved that a compiler defines: it breaks)


def reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot be a spec argument because of the generated C++, or None."""
    for cls in CLASSES:
        if name in cls.names:
            return f"`{name}` is {cls.why}; the generated code could not use it as an argument name"
    if RESERVED_PATTERN.fullmatch(name):
        return (f"`{name}` is reserved to the compiler and library by the C++ standard (a name with '__', or "
                "starting with '_'); the generated code could not rely on it")
    return None
