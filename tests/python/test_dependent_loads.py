"""scripts/check_dependent_loads.py on small synthetic SASS: it must flag a
non-coherent load of a previous grid's data in a kernel that waits, and only
that."""

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_dependent_loads.py"
_spec = importlib.util.spec_from_file_location("check_dependent_loads", _PATH)
cdl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cdl  # dataclasses look their module up
_spec.loader.exec_module(cdl)

# k(float const* x, lowbit::cuda::ReadOnly<float> bias, long n, float* out):
# parameters at 0x210, 0x218, 0x220, 0x228.
NAME = "_Z1kPKfN6lowbit4cuda8ReadOnlyIfEElPf"
ELF = f"""
.nv.info.{NAME}
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x3	Offset  : 0x18	Size    : 0x8
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x2	Offset  : 0x10	Size    : 0x8
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x1	Offset  : 0x8	Size    : 0x8
	Attribute:	EIATTR_KPARAM_INFO
	Format:	EIFMT_SVAL
	Value:	Index : 0x0	Ordinal : 0x0	Offset  : 0x0	Size    : 0x8
	Attribute:	EIATTR_PARAM_CBANK
	Format:	EIFMT_SVAL
	Value:	0x5 0x200210
"""


def sass(body: str, wait: bool = True) -> str:
    lines = [f"\t\tFunction : {NAME}"]
    ins = ["S2R R0, SR_TID.X", "ULDC.64 UR4, c[0x0][0x208]"]
    ins += ["ACQBULK"] if wait else []
    ins += [l.strip() for l in body.strip().splitlines()] + ["EXIT"]
    for i, s in enumerate(ins):
        lines.append(f"        /*{16 * i:04x}*/                   {s} ;   /* 0x0 */")
    return "\n".join(lines) + "\n"


def run(body: str, wait: bool = True):
    return cdl.check(sass(body, wait), ELF)


# x[tid] through the non-coherent path: the route kernel's bug.
X_NC = """
LDC.64 R2, c[0x0][0x210]
IMAD.WIDE.U32 R2, R0, 0x4, R2
LDG.E.CONSTANT R5, desc[UR4][R2.64]
"""


def test_flags_noncoherent_load_of_previous_grid_data():
    dependent, violations = run(X_NC)
    assert dependent == 1
    assert len(violations) == 1
    assert "parameter 0 (float const*)" in violations[0].params


def test_coherent_load_passes():
    assert run(X_NC.replace(".CONSTANT", ""))[1] == []


def test_readonly_parameter_may_be_noncoherent():
    body = X_NC.replace("c[0x0][0x210]", "c[0x0][0x218]")
    assert run(body)[1] == []


def test_scalar_index_does_not_count():
    body = """
    LDC.64 R2, c[0x0][0x218]
    ULDC UR6, c[0x0][0x220]
    IMAD.WIDE.U32 R2, R0, UR6, R2
    LDG.E.CONSTANT R5, desc[UR4][R2.64]
    """
    assert run(body)[1] == []


def test_kernel_without_wait_is_not_checked():
    dependent, violations = run(X_NC, wait=False)
    assert dependent == 0 and violations == []


def test_register_reuse_is_tracked_by_flow():
    # R2 first holds x (read coherently), then bias (read non-coherently).
    body = """
    LDC.64 R2, c[0x0][0x210]
    LDG.E R5, desc[UR4][R2.64]
    LDC.64 R2, c[0x0][0x218]
    LDG.E.CONSTANT R6, desc[UR4][R2.64]
    """
    assert run(body)[1] == []


def test_join_of_branches_is_conservative():
    # On one path R2 is bias, on the other x: the load after the join is flagged.
    body = """
    LDC.64 R2, c[0x0][0x218]
    @P0 BRA 0x0080
    LDC.64 R2, c[0x0][0x210]
    LDG.E.CONSTANT R6, desc[UR4][R2.64]
    """
    assert len(run(body)[1]) == 1


def test_predicated_write_keeps_old_value():
    body = """
    LDC.64 R2, c[0x0][0x218]
    @P1 LDC.64 R2, c[0x0][0x210]
    LDG.E.CONSTANT R6, desc[UR4][R2.64]
    """
    assert len(run(body)[1]) == 1


def test_address_from_memory_is_flagged():
    body = """
    LDC.64 R2, c[0x0][0x218]
    LDG.E.64 R4, desc[UR4][R2.64]
    LDG.E.CONSTANT R6, desc[UR4][R4.64]
    """
    assert len(run(body)[1]) == 1


def test_split_params():
    d = ("void lowbit::a::(anonymous namespace)::k<__half, 8>(__half const*, lowbit::cuda::ReadOnly<unsigned char>, "
         "lowbit::a::(anonymous namespace)::Pair<int, float>, long)")
    types = cdl.split_params(d)
    assert types == ["__half const*", "lowbit::cuda::ReadOnly<unsigned char>",
                     "lowbit::a::(anonymous namespace)::Pair<int, float>", "long"]
    assert [cdl.classify(t) for t in types] == ["pointer", "readonly", "pointer", "scalar"]
