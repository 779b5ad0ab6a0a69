"""Compile-time checks of tilefuse's Triton kernels for Hopper (sm_90a) and Blackwell (sm_100a).

Every production kernel, in every configuration its heuristics pick (:mod:`.variants`), is
compiled for both targets on any machine, GPU or not (:mod:`.compile`), and checked
(:mod:`.checks`): fast matrix instructions for every dot, no spills, shared memory within the
limit. ``tilefuse kernels`` (:mod:`.cli`) prints the table; ``tests/kernelcheck`` asserts it.
"""
