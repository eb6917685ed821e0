"""Export of a trained model as one safetensors directory, and the check of the directory it replaces.

Private: the public names are re-exported from ``d9d.loop``.
"""
