"""The names the re-measured candidates go by (finalists.csv's rows, the summary's table): the alternatives every
result is measured beside, in their order, and those that are no per-layer policy. Data only, at the bottom of the
tuner, so that the goals and the choice read them without importing how the alternatives are built
(_alternatives.py)."""

FP32 = "fp32"
TF32 = "TF32"
BF16 = "uniform bf16"
FP8_EVERYWHERE = "fp8 everywhere (torchao filter)"
FP8_ROWWISE_EVERYWHERE = "fp8 rowwise everywhere (torchao filter)"
GREEDY = "profile greedy"
BF16_GRAPHS = "uniform bf16, CUDA graphs"
ALTERNATIVES = (
    FP32,
    TF32,
    BF16,
    BF16_GRAPHS,
    FP8_EVERYWHERE,
    FP8_ROWWISE_EVERYWHERE,
    GREEDY,
)  # re-measured beside every result, in this order

NOT_A_POLICY = frozenset({TF32, BF16_GRAPHS})  # measured for comparison; cannot be written as a per-layer policy
