"""Bound computations over a :class:`~lightning_fedshard.verify.graph.BoundGraph`: CROWN passes, α-CROWN, β-CROWN."""
