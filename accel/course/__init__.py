"""The course's own experiments, on top of the library: benchmarks (``python -m accel bench``),
figures (``make images``) and the toy set-ups and demos the chapters run. This is the only part
of the package that calls ``accel.devices.setup()``; everything below it takes devices as
arguments.
"""
