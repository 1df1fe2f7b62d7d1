"""One APIRouter per resource: health, weights, matmul (native), v2 (Open Inference Protocol),
metrics."""
