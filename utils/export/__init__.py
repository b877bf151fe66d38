"""A checkpoint of any layout as one file, or as a Hugging Face folder, and back: `python -m utils.export`
(convert: the commands export, import, export-hf and import-hf). A tool over the checkpoints (utils/checkpoints/)
and the run directory's facts, which may compose presets from the command line (import-hf names the settings a
run from the imported weights needs).
"""
