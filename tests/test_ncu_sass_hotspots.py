"""benchmarks/ncu_sass_hotspots.py: the top stalled SASS instructions per kernel from ncu's source page CSV."""

from benchmarks.ncu_sass_hotspots import hotspots

PAGE = """==PROF== Connected to process 1
"Kernel Name","kernel_a",
"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb"
"0x10","LDG.E.128 R4, [R2.64]","30","25"
"0x20","HMMA.16816.F32.BF16 R8, R4, R6, R8","10","0"
"Kernel Name","kernel_b",
"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb"
"0x10","BAR.SYNC 0x0","5","0"
"0x20","IMAD.MOV.U32 R52, RZ, RZ, R64","15","12"
"""


def test_each_kernel_gets_its_own_page_and_name():
    lines = hotspots(PAGE, top=5)
    heads = [ln for ln in lines if ln.startswith("==")]
    assert heads == ["== kernel_a: 40 samples, 2 instructions", "== kernel_b: 20 samples, 2 instructions"]
    a = lines[lines.index(heads[0]) + 1]
    assert a.startswith(" 75.0%") and "LDG.E.128" in a and "stall_long_sb 25" in a  # 30 of kernel_a's 40
    b = lines[lines.index(heads[1]) + 1]
    assert b.startswith(" 75.0%") and "IMAD.MOV.U32" in b  # the most sampled first


def test_no_page_says_so():
    assert "no source page" in hotspots("==PROF== nothing\n", top=3)[0]
