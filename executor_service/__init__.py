"""The executor: loads a target (and a drafter) with the selected attention kernels and generates."""
