"""The developer scripts' parsing (no GPU): racecheck's reports grouped by class."""

from scripts import racecheck_classes

REPORT = """========= COMPUTE-SANITIZER
========= Error: Potential WAR hazard detected at __shared__ 0x8404 in block (0,0,0) :
=========     Read Thread (97,0,0) at void snack::cuda::detail::load_row_block<(bool)0>(unsigned int (&)[4][4], const unsigned int *, int)+0x20b0 in fragment_wgmma_kernel.cuh:37
=========     Write Thread (256,0,0) at snack::cuda::detail::bulk_load(void *, const void *, unsigned int, unsigned long *)+0x3f00 in hopper.cuh:72
=========     Current Value : 0, Incoming Value : ?
=========
========= Warning: Potential WAW hazard detected at __shared__ 0x10 in block (3,0,0) :
=========     Write Thread (1,0,0) at void k<int>(int *)+0x10 in a.cuh:5
=========     Write Thread (40,0,0) at void k<int>(int *)+0x20 in a.cuh:9
=========     Current Value : 0, Incoming Value : 0
=========
========= Error: Potential WAR hazard detected at __shared__ 0x8408 in block (1,0,0) :
=========     Read Thread (3,0,0) at void snack::cuda::detail::load_row_block<(bool)0>(unsigned int (&)[4][4], const unsigned int *, int)+0x20b0 in fragment_wgmma_kernel.cuh:37
=========     Write Thread (256,0,0) at snack::cuda::detail::bulk_load(void *, const void *, unsigned int, unsigned long *)+0x3f00 in hopper.cuh:72
=========     Current Value : 5, Incoming Value : ?
=========
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)
"""


def test_racecheck_reports_are_grouped_by_their_pair_of_sites():
    classes, summary = racecheck_classes.classify(REPORT.splitlines())
    pair = ("Error", "WAR", "__shared__", "Read at snack::cuda::detail::load_row_block<(bool)0> (fragment_wgmma_kernel.cuh:37)",
            "Write at snack::cuda::detail::bulk_load (hopper.cuh:72)")
    assert classes[pair] == 2
    assert classes[("Warning", "WAW", "__shared__", "Write at k<int> (a.cuh:5)", "Write at k<int> (a.cuh:9)")] == 1
    assert sum(classes.values()) == 3
    assert summary == ["RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warnings)"]


def test_racecheck_reports_of_other_forms_are_counted_not_dropped():
    # A category before "Potential" parses as the hazard form; a first line of any other form is a
    # class of its own, named by the line without its addresses and numbers.
    lines = """========= Warning: (Warp Level Programming) Potential RAW hazard detected at __shared__ 0x20 in block (0,0,0) :
=========     Write Thread (1,0,0) at void k<int>(int *)+0x10 in a.cuh:5
=========     Read Thread (2,0,0) at void k<int>(int *)+0x30 in a.cuh:7
========= Error: Race reported between Write access at 0x1f0 in k.cu:12 and Read access at 0x2a0 in k.cu:30 [1024 hazards]
========= Error: Race reported between Write access at 0x1f0 in k.cu:12 and Read access at 0x2a0 in k.cu:30 [8 hazards]
========= RACECHECK SUMMARY: 1026 hazards displayed (1025 errors, 1 warnings)
""".splitlines()
    classes, summary = racecheck_classes.classify(lines)
    assert classes[("Warning", "RAW", "__shared__", "Write at k<int> (a.cuh:5)", "Read at k<int> (a.cuh:7)")] == 1
    race = ("Error", "unparsed",
            "Race reported between Write access at # in k.cu:# and Read access at # in k.cu:# [# hazards]")
    assert classes[race] == 2
    assert sum(classes.values()) == 3
    assert summary == ["RACECHECK SUMMARY: 1026 hazards displayed (1025 errors, 1 warnings)"]
