"""What a driver does: the pytest process of a serial run, or an xdist worker. It collects the
tests, starts gangs from its zygote and sends each marked test to one, and logs the reports its
ranks send back."""
