"""The numbers printed in the SwitchHead paper, shipped as package data."""

from importlib.resources import files

TABLES = files("switchbench.bench") / "data" / "published_tables.csv"
WALLCLOCK = files("switchbench.bench") / "data" / "published_wallclock.csv"
# The claims of the text, each with how far a measurement may be from it and still reproduce it.
CLAIMS = files("switchbench.bench") / "data" / "published_claims.csv"
