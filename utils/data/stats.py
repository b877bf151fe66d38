"""`python -m utils.data.stats`: the normalization statistics of a weather store (the weather wing), the command of
utils/weather/data/stats.py under the name users
run. It names that module only as text (utils/startup.py `run_tool`), so the core's data folder imports no wing."""

from utils.startup import run_tool

if __name__ == "__main__":
    run_tool("utils.weather.data.stats")
