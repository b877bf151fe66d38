"""The weather wing: ERA5 and WeatherBench 2 readers behind the weather reader interface (data/: fields.py), the
forecast task with its losses, WeatherBench 2 metrics, spectra, ensembles and figures (task/). Its commands keep
the names users run: `python -m utils.forecast` (utils/forecast/), `python -m utils.data.stats` and
`python -m utils.data.era5_zarr_synthetic`. The core names none of it: the families name the task ("weather"), found
in task/__init__.py's TASKS, and the task names its readers (`DATA_SCHEMAS`)."""
