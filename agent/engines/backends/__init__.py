"""Build backends: tensorrt on devices, onnxruntime on any host. Imported lazily."""
