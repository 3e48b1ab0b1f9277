// Package config reads kvmount's TOML configuration file (schema v1, see
// DESIGN.md): global settings, [sources.NAME] tables decoded by their source
// kind, and [[mount]] tables. Decoding is strict and reports every problem
// at once, each with file and line.
package config

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/kvmount/kvmount/projector"
)

// Defaults of the global settings.
const (
	DefaultPath           = "/etc/kvmount/kvmount.toml"
	DefaultStateDir       = "/var/lib/kvmount"
	DefaultResyncInterval = 2 * time.Minute
	// MinResyncInterval is the shortest resync_interval: a resync reads
	// every mount from disk, and changes never wait for it.
	MinResyncInterval = time.Second
	// DefaultAdminAddress is the public admin endpoint's address:
	// loopback, on a port in the range of Prometheus' default port
	// allocations for exporters (9100–9999).
	DefaultAdminAddress = "127.0.0.1:9797"
	// DefaultAdminSocket is the private admin endpoint's unix socket, in
	// the runtime directory systemd makes for the unit
	// (RuntimeDirectory=kvmount).
	DefaultAdminSocket = "/run/kvmount/kvmount.sock"
	// MinPollInterval is the shortest poll_interval of any source kind.
	MinPollInterval = 100 * time.Millisecond
	// DefaultMode is the kubelet's default file mode for ConfigMap volumes.
	DefaultMode fs.FileMode = 0o644
	// DefaultDirMode is the mode of a mount's directories (the kubelet's
	// version directories are 0755).
	DefaultDirMode fs.FileMode = 0o755
	// DefaultSizeLimit is a tmpfs mount's size, 16 MiB.
	DefaultSizeLimit = 16 << 20
	// DefaultMaxValueSize is the largest value projected, 1 MiB: the
	// limit of a Kubernetes ConfigMap or Secret.
	DefaultMaxValueSize = 1 << 20
	// DefaultMaxFiles is the most files a mount's payload may hold.
	DefaultMaxFiles = 10_000
	// DefaultMaxTotalSize bounds every mount's payload together, 1 GiB.
	DefaultMaxTotalSize = 1 << 30
	// DefaultCheckTimeout bounds a mount's check_command.
	DefaultCheckTimeout = 30 * time.Second
	// DefaultKeepReplaced is how long a replaced version stays after a
	// switch (keep_replaced; projector.WriterOptions.Grace).
	DefaultKeepReplaced = projector.DefaultGrace
)

// Medium names.
const (
	MediumDisk  = "disk"
	MediumTmpfs = "tmpfs"
)

// Config is a decoded, validated configuration file.
type Config struct {
	// Path is the file it was read from.
	Path string
	// Text is the file's content as read: what the worker parses again.
	Text []byte
	// StateDir holds kvmount's record of the mounts it owns.
	StateDir string
	// LogLevel is the lowest level logged.
	LogLevel slog.Level
	// LogFormat is "text" or "json".
	LogFormat string
	// ResyncInterval is how often every mount is compared with the disk to
	// repair drift (a file removed by hand). Changes from sources never
	// wait for it.
	ResyncInterval time.Duration
	// KeepReplaced is the default of the mounts' KeepReplaced
	// (keep_replaced).
	KeepReplaced time.Duration
	// MaxTotalSize bounds the payloads of every mount together, in bytes
	// (max_total_size): what root holds of them at once. A payload that
	// would take the total past it is not projected; its mount keeps its
	// content.
	MaxTotalSize int64
	// Sources by name.
	Sources map[string]*Source
	// Mounts in file order.
	Mounts []*Mount
	// Admin is the address of the public admin endpoint ("host:port" on
	// loopback, or "unix:/path"): /metrics, /healthz, /readyz; "" turns it
	// off.
	Admin string
	// AdminSocket is the path of the private admin endpoint, a unix
	// socket only root can use: every route and /status, which kvmount
	// status reads; "" turns it off.
	AdminSocket string
	// Warnings are valid but probably unintended settings, such as a
	// prefix without a trailing "/", in file order; kvmount check prints
	// them and the daemon logs them.
	Warnings ErrorList
}

// Source is one [sources.NAME] table.
type Source struct {
	Name string
	// Type is the source kind: "etcd", "consul", "http".
	Type string
	// Settings is what the kind's decoder returned.
	Settings any
}

// Mount is one [[mount]] table.
type Mount struct {
	// Name is unique; [a-z0-9][a-z0-9_.-]*.
	Name string
	// Dir is the absolute, clean directory kvmount owns and fills.
	Dir string
	// Medium is MediumDisk or MediumTmpfs.
	Medium string
	// SizeLimit is the tmpfs size in bytes (medium tmpfs only).
	SizeLimit int64
	// DefaultMode is the permission of files without an item mode.
	DefaultMode fs.FileMode
	// DefaultModeSet reports whether default_mode was written, not
	// taken by default: a source may then default a secret file to a
	// stricter mode (a private key's 0600).
	DefaultModeSet bool
	// DirMode is the permission of the mount's directories: the mount
	// directory kvmount creates (or the tmpfs root), the version
	// directories and the directories inside them.
	DirMode fs.FileMode
	// UID and GID own the mount's files and directories; -1 means
	// kvmount's own user or group.
	UID, GID int
	// Optional makes a missing prefix or item no error.
	Optional bool
	// Projections contribute keys; the single-projection shorthand
	// (source, prefix, items) becomes one.
	Projections []Projection
	// Immutable mounts are projected once and then no longer followed
	// (the kubelet's immutable ConfigMaps); a reload or restart reads them
	// again.
	Immutable bool
	// AllowEmpty lets an empty snapshot replace a non-empty mount.
	AllowEmpty bool
	// MinKeys holds back any payload with fewer files.
	MinKeys int
	// CheckCommand, when set, runs against each new version directory
	// before the switch ({{dir}} in an argument is replaced by its path);
	// a failure keeps the old version.
	CheckCommand []string
	// CheckTimeout bounds CheckCommand.
	CheckTimeout time.Duration
	// ShowCheckOutput puts the last lines of a failed CheckCommand's
	// output into its error (log, /status, kvmount status, systemd's
	// status line): on disk by default, not on tmpfs, whose checks may
	// echo secrets.
	ShowCheckOutput bool
	// Notify are the entries run, in order, after each switch that
	// changed the mount.
	Notify []Notify
	// Wait is the mount's quiescence; zero Min means none.
	Wait Wait
	// Templates are files rendered from the mount's keys, parsed from
	// [[mount.templates]].
	Templates []*projector.Template
	// KeysAsFiles projects the keys as files; false makes them feed the
	// templates only.
	KeysAsFiles bool
	// CheckUID and CheckGID are the user and group CheckCommand runs as:
	// check_user (a name, whose primary group applies, or a numeric id,
	// whose group is the same number when no such user exists); by
	// default the mount's user (and group) unless that is root, else
	// nobody (Nobody). A check interprets store content, so it runs with
	// least privilege unless the configuration says check_user = "root".
	CheckUID, CheckGID int
	// NotifyUID and NotifyGID are the user and group the mount's notify
	// commands run as (notify_user), with the same default and rule.
	NotifyUID, NotifyGID int
	// MaxValueSize is the largest value projected, in bytes.
	MaxValueSize int64
	// MaxMountSize is the largest payload, in bytes; 0 for no limit.
	MaxMountSize int64
	// MaxFiles is the most files a payload may hold (max_files), on every
	// medium; a tmpfs is mounted with an inode limit to match.
	MaxFiles int
	// KeepReplaced is how long a replaced version directory stays after
	// a switch, for readers that resolved ..data just before it
	// (keep_replaced, default 5 s); zero removes it right after the
	// switch, as the kubelet does.
	KeepReplaced time.Duration
}

// Projection is one source and prefix of a mount.
type Projection struct {
	Source string
	Prefix string
	// Optional makes a missing prefix or item of this projection no error.
	Optional bool
	// Items, when not nil, choose the keys projected.
	Items []Item
}

// Item maps one key (relative to the prefix) to a path.
type Item struct {
	Key  string
	Path string
	// Mode is zero for the mount's default mode.
	Mode     fs.FileMode
	Optional bool
}

// SourceDecoder decodes and validates a [sources.NAME] table of one source
// kind, reporting every problem through sec (Section.Errorf) and asking for
// every key it knows, so that Load can report the rest as unknown.
type SourceDecoder func(sec *Section) any

// Load reads and validates the configuration file at path; kinds maps each
// source type to its decoder. Problems in the file are returned together as
// an ErrorList.
func Load(path string, kinds map[string]SourceDecoder) (*Config, error) {
	return LoadWith(path, kinds, Disk{})
}

// LoadWith is Load reading the files the configuration names (credential,
// TLS and template files) through files, such as a Recorder.
func LoadWith(path string, kinds map[string]SourceDecoder, files Files) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return ParseWith(path, data, kinds, files)
}

// Parse is Load for a file already read; name is used in errors.
func Parse(name string, data []byte, kinds map[string]SourceDecoder) (*Config, error) {
	return ParseWith(name, data, kinds, Disk{})
}

// ParseWith is Parse reading the files the configuration names through
// files, such as a Replay of what the monitor read.
func ParseWith(name string, data []byte, kinds map[string]SourceDecoder, files Files) (*Config, error) {
	var raw map[string]any
	if _, err := toml.Decode(string(data), &raw); err != nil {
		var perr toml.ParseError
		if errors.As(err, &perr) {
			return nil, ErrorList{{File: name, Line: perr.Position.Line, Msg: perr.Message}}
		}
		return nil, ErrorList{{File: name, Msg: err.Error()}}
	}
	lines, complete := locateKeys(string(data))
	doc := &document{file: name, src: string(data), lines: lines, complete: complete, files: files}
	top := newSection(doc, nil, "", raw)
	cfg := &Config{Path: name, Text: data, Sources: map[string]*Source{}}
	cfg.StateDir = top.String("state_dir", DefaultStateDir)
	if !filepath.IsAbs(cfg.StateDir) {
		top.Errorf("state_dir", "%q is not an absolute path", cfg.StateDir)
	}
	cfg.StateDir = filepath.Clean(cfg.StateDir)
	level := top.Choice("log_level", "info", "debug", "info", "warn", "error")
	_ = cfg.LogLevel.UnmarshalText([]byte(level))
	cfg.LogFormat = top.Choice("log_format", "text", "text", "json")
	cfg.ResyncInterval = top.DurationAtLeast("resync_interval", DefaultResyncInterval, MinResyncInterval)
	cfg.KeepReplaced = top.DurationOrZero("keep_replaced", DefaultKeepReplaced)
	cfg.MaxTotalSize = top.Size("max_total_size", DefaultMaxTotalSize)
	if cfg.MaxTotalSize <= 0 {
		top.Errorf("max_total_size", "want a positive size, such as \"1GiB\"")
	}
	cfg.Admin, cfg.AdminSocket = DefaultAdminAddress, DefaultAdminSocket
	if top.Has("admin") {
		admin := top.Table("admin")
		cfg.Admin = admin.String("address", DefaultAdminAddress)
		cfg.AdminSocket = admin.String("socket", DefaultAdminSocket)
		if p := cfg.AdminSocket; p != "" && (!filepath.IsAbs(p) || filepath.Clean(p) != p || len(p) > 107) {
			admin.Errorf("socket", "%q: want an absolute, clean path of at most 107 bytes (a unix socket address's limit)", p)
		}
		if a := cfg.Admin; a != "" && !strings.HasPrefix(a, "unix:/") {
			if host, _, err := net.SplitHostPort(a); err != nil {
				admin.Errorf("address", "%q: want \"host:port\" or \"unix:/path\"", a)
			} else if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
				admin.Errorf("address", "%q is not a loopback address; the admin endpoint has no authentication", a)
			}
		}
		admin.Done()
	}

	sources := top.Table("sources")
	for _, name := range sources.Keys() {
		sec := sources.Table(name)
		if !validName.MatchString(name) {
			sec.Errorf("", "source name %q must match %s", name, validName)
		}
		typ := sec.String("type", "")
		decode, ok := kinds[typ]
		switch {
		case typ == "":
			sec.Errorf("", "type is missing; want one of %s", kindList(kinds))
		case !ok:
			sec.Errorf("type", "unknown source type %q; want one of %s", typ, kindList(kinds))
		default:
			cfg.Sources[name] = &Source{Name: name, Type: typ, Settings: decode(sec)}
		}
		if ok || typ == "" {
			sec.Done()
		}
	}
	sources.Done()

	mounts := top.Tables("mount")
	for _, sec := range mounts {
		cfg.Mounts = append(cfg.Mounts, decodeMount(sec, cfg))
	}
	top.Done()
	checkMounts(mounts, cfg)
	if len(doc.errs) > 0 {
		slices.SortStableFunc(doc.errs, func(a, b *Error) int { return a.Line - b.Line })
		return nil, doc.errs
	}
	slices.SortStableFunc(doc.warnings, func(a, b *Error) int { return a.Line - b.Line })
	cfg.Warnings = doc.warnings
	return cfg, nil
}

// validName is the form of mount and source names.
var validName = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]*$`)

func kindList(kinds map[string]SourceDecoder) string {
	names := make([]string, 0, len(kinds))
	for k := range kinds {
		names = append(names, fmt.Sprintf("%q", k))
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}
