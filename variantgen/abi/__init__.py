"""The layouts and enums shared between Python and the generated C++ (rendered into vg_plan_abi.h)."""
