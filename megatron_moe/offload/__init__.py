"""MoESys hierarchical storage for training (expert offload to host / SSD). See docs/offload.md.

The copy link and slot arena shared with ring-memory inference are in ``offload/link.py``.
"""
