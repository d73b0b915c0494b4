"""Neural-network verification: ONNX + VNN-LIB in, IBP / CROWN / α-CROWN / β-CROWN branch-and-bound, verdicts out."""
