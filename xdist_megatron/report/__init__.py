"""The run report: what each driver stamps on its reports, and the timeline, terminal section
and Gantt chart made of them where every report arrives (the serial driver or the controller)."""
