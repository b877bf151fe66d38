"""`python -m utils.checkpoints.export ...`: the conversion command's former name, kept for users' scripts; the
command is `python -m utils.export` (utils/export/convert.py). It names the command only as text
(utils/startup.py `run_tool`), so this file imports nothing above the checkpoint layer it sits in."""

from utils.startup import run_tool

if __name__ == "__main__":
    run_tool("utils.export.convert")
