"""The weather wing's readers: the reader interface (fields.py), NERSC HDF5 (era5.py), WeatherBench 2 zarr
(era5_zarr.py), the synthetic stores and the statistics command."""
