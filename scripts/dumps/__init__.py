"""What a user runs around a dump: the server launcher, the tiny test models, the demo, the
dump's inspector and its exports to trainers' layouts."""
