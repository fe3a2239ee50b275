"""The run report, where every report arrives (the serial driver or the xdist controller): the
timeline gathered from the facts each driver stamps on its reports (driver/run_facts.py), the
terminal section and the Gantt chart."""
