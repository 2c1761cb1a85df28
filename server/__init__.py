"""The serving process and the `scriptserve` command."""
