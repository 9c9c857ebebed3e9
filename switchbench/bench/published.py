"""The numbers printed in the SwitchHead paper, shipped as package data."""

from importlib.resources import files

TABLES = files("switchbench.bench") / "data" / "published_tables.csv"
WALLCLOCK = files("switchbench.bench") / "data" / "published_wallclock.csv"
