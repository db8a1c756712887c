# Thin shim: the model lives in backends/triton_models/drafter.py (importable and tested).
from backends.triton_models.drafter import TritonPythonModel  # noqa: F401
