"""lrq: quantization primitives, schemes, the quantized linear module and the LRQ method."""

__version__ = "0.1.0"
