"""Llama-family decoder (the model file is only the model; quantization is applied from outside)."""
