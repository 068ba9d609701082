"""Calibration sources and statistics capture (installed as ``moecompress.calibration``).

Filled by the recipe-engine work; present now so the package layout is final.
"""
