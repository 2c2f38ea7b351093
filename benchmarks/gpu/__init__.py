"""The stages of ``benchmarks/gpu_check.py``: one module each (`env`, `kernels`,
`kernel_speed`, `simulator`, `lm`), the stage record they write (`record`) and the
markdown made of the records (`report`)."""
