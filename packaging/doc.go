// Package packaging holds what installs kvmount as a service — the systemd
// unit, the default configuration, the maintainer scripts, the man page and
// nfpm's description of the .deb and .rpm packages (built by `make
// package`) — and the tests that prove them: the packages' contents, and
// an install, reload, crash, upgrade and purge on a real systemd booted in
// a container. It has no Go code of its own.
package packaging
