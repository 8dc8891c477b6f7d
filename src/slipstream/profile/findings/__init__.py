"""One module per finding kind; each `find_*` takes a Capture and returns a list of Finding."""
