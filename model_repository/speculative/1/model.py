# Thin shim: the model lives in backends/triton_models/speculative.py (importable and tested).
from backends.triton_models.speculative import TritonPythonModel  # noqa: F401
