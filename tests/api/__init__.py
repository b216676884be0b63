"""The contract and the forms below the shells: api/ (decoding, reports, exit codes), the job file, durations."""
