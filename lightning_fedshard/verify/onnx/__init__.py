"""Reading ONNX models into :class:`~lightning_fedshard.verify.graph.BoundGraph`s."""
