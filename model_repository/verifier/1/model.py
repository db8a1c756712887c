# Thin shim: the model lives in backends/triton_models/verifier.py (importable and tested).
from backends.triton_models.verifier import TritonPythonModel  # noqa: F401
