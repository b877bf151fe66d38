"""The weather wing's task (weather.py) and what it computes: losses, metrics, rollouts and WeatherBench 2 skill,
spectra, ensembles, figures. `TASKS` is how the core finds it (utils/tasks/__init__.py `tasks`)."""

from utils.weather.task.weather import WeatherTask

TASKS = {"weather": WeatherTask}
