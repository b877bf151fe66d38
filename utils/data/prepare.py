"""`python -m utils.data.prepare`: token shards of a text corpus (the language wing), the command of
utils/language/data/prepare.py under the name users
run. It names that module only as text (utils/startup.py `run_tool`), so the core's data folder imports no wing."""

from utils.startup import run_tool

if __name__ == "__main__":
    run_tool("utils.language.data.prepare")
