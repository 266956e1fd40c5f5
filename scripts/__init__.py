"""Tools run by hand and by tests: `two_node.py` (two machines in network namespaces, with `netns.py`),
`check_cuda.py` (does the GPU stack work here)."""
