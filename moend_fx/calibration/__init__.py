"""Offline calibration: texts -> SensitivityTable.

Takes a model, its tokenizer and calibration text; captures per-layer K/V/Q windows and pre-RoPE query
statistics (``capture``), measures the relative attention-output error of every grid config on every layer
(``pipeline.calibrate``), and gives the :class:`~moend_fx.calibration.sensitivity.SensitivityTable`
S[layers, configs] + bytes[layers, configs] (safetensors + JSON, never pickle)."""
