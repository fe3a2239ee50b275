"""What a CI job runs: selection by world size, shards by device time, test durations."""
