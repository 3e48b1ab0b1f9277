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

func decodeMount(sec *Section, cfg *Config) *Mount {
	defer sec.Done()
	m := &Mount{UID: -1, GID: -1}
	m.Name = sec.String("name", "")
	switch {
	case m.Name == "":
		sec.Errorf("", "name is missing")
	case !validName.MatchString(m.Name):
		sec.Errorf("name", "%q must match %s", m.Name, validName)
	}
	m.Dir = sec.String("dir", "")
	if m.Dir == "" {
		sec.Errorf("", "dir is missing")
	} else if err := checkDir(m.Dir); err != nil {
		sec.Errorf("dir", "%v", err)
	}
	m.Dir = filepath.Clean(m.Dir)
	m.Medium = sec.Choice("medium", MediumDisk, MediumDisk, MediumTmpfs)
	if m.Medium == MediumTmpfs {
		m.SizeLimit = sec.Size("size_limit", DefaultSizeLimit)
	} else if sec.Has("size_limit") {
		sec.Size("size_limit", 0)
		sec.Errorf("size_limit", "applies to medium \"tmpfs\" only")
	}
	m.DefaultMode = sec.Mode("default_mode", DefaultMode)
	m.DefaultModeSet = sec.Has("default_mode")
	m.DirMode = sec.Mode("dir_mode", DefaultDirMode)
	m.Immutable = sec.Bool("immutable", false)
	m.AllowEmpty = sec.Bool("allow_empty", false)
	m.MinKeys = int(sec.Int("min_keys", 0, 0, 1<<31-1))
	m.CheckCommand = sec.Strings("check_command")
	if sec.Has("check_command") && (len(m.CheckCommand) == 0 || m.CheckCommand[0] == "") {
		sec.Errorf("check_command", "needs a program, such as [\"nginx\", \"-t\", \"-c\", \"{{dir}}/nginx.conf\"]")
	}
	m.CheckTimeout = sec.Duration("check_timeout", DefaultCheckTimeout)
	m.ShowCheckOutput = sec.Bool("show_check_output", m.Medium != MediumTmpfs)
	if sec.Has("show_check_output") && !sec.Has("check_command") {
		sec.Errorf("show_check_output", "applies with check_command only")
	}
	if sec.Has("check_timeout") && !sec.Has("check_command") {
		sec.Errorf("check_timeout", "applies with check_command only")
	}
	m.MaxValueSize = sec.Size("max_value_size", DefaultMaxValueSize)
	m.MaxMountSize = sec.Size("max_mount_size", 0)
	m.MaxFiles = int(sec.Int("max_files", DefaultMaxFiles, 1, 1<<24))
	m.KeepReplaced = sec.DurationOrZero("keep_replaced", cfg.KeepReplaced)
	m.UID = lookupID(sec, "user", lookupUser)
	m.GID = lookupID(sec, "group", lookupGroup)
	m.Optional = sec.Bool("optional", false)
	m.Wait = decodeWait(sec)
	for _, nsec := range sec.Tables("notify") {
		m.Notify = append(m.Notify, decodeNotify(nsec))
	}
	m.CheckUID, m.CheckGID = commandUser(sec, "check_user", m)
	if sec.Has("check_user") && !sec.Has("check_command") {
		sec.Errorf("check_user", "applies with check_command only")
	}
	m.NotifyUID, m.NotifyGID = commandUser(sec, "notify_user", m)
	for i := range m.Notify {
		m.Notify[i].UID, m.Notify[i].GID = m.NotifyUID, m.NotifyGID
	}
	if sec.Has("notify_user") && !slices.ContainsFunc(m.Notify, func(n Notify) bool { return n.Kind == NotifyCommand }) {
		sec.Errorf("notify_user", "applies with a [[mount.notify]] command entry only")
	}
	if len(m.CheckCommand) > 0 {
		warnUnreadable(sec, m)
	}

	paths := map[string]bool{} // item paths of all projections
	shorthand := sec.Has("source") || sec.Has("prefix") || sec.Has("items")
	if sec.Has("projections") {
		if shorthand {
			sec.Errorf("projections", "a mount uses either source/prefix/items or [[mount.projections]], not both")
		}
		for _, psec := range sec.Tables("projections") {
			m.Projections = append(m.Projections, decodeProjection(psec, cfg, m, paths))
			psec.Done()
		}
		if len(m.Projections) == 0 {
			sec.Errorf("projections", "needs at least one projection")
		}
	} else if shorthand {
		m.Projections = []Projection{decodeProjection(sec, cfg, m, paths)}
	} else {
		sec.Errorf("", "source is missing: set source and prefix, or [[mount.projections]]")
	}
	m.Templates = decodeTemplates(sec, paths, m, cfg)
	m.KeysAsFiles = sec.Bool("keys_as_files", true)
	if !m.KeysAsFiles && len(m.Templates) == 0 && !sec.Has("templates") {
		sec.Errorf("keys_as_files", "false makes the keys feed templates only, and the mount has no [[mount.templates]]")
	}
	return m
}

// decodeProjection decodes one projection of m; paths collects the item
// paths of the mount's projections, to reject two items producing one
// path.
func decodeProjection(sec *Section, cfg *Config, m *Mount, paths map[string]bool) Projection {
	p := Projection{Optional: m.Optional}
	p.Source = sec.String("source", "")
	src, ok := cfg.Sources[p.Source]
	switch {
	case p.Source == "":
		sec.Errorf("", "source is missing")
	case !ok:
		sec.Errorf("source", "unknown source %q; declare it as [sources.%s]", p.Source, p.Source)
	}
	if d, own := sourceSettings(src).(ProjectionDecoder); own {
		p.Prefix = d.DecodeProjection(sec, m)
	} else {
		p.Prefix = sec.String("prefix", "")
		if p.Prefix != "" && !strings.HasSuffix(p.Prefix, "/") {
			sec.Warnf("prefix", "%q does not end in \"/\": etcd and Consul prefixes match every key that starts with it (%q matches %q too)", p.Prefix, p.Prefix, p.Prefix+"-other/x")
		}
	}
	if sec.Has("optional") {
		p.Optional = sec.Bool("optional", m.Optional)
	}
	if sec.Has("items") {
		p.Items = []Item{}
		for _, isec := range sec.Tables("items") {
			it := Item{Optional: false}
			it.Key = isec.String("key", "")
			if it.Key == "" {
				isec.Errorf("", "key is missing")
			}
			it.Path = isec.String("path", "")
			if it.Path == "" {
				isec.Errorf("", "path is missing")
			} else if clean, err := projector.CleanPath(it.Path); err != nil {
				isec.Errorf("path", "%v", err)
			} else if paths[clean] {
				isec.Errorf("path", "%q produces the path %q of another item", it.Path, clean)
			} else {
				paths[clean] = true
			}
			it.Mode = isec.Mode("mode", 0)
			it.Optional = isec.Bool("optional", false)
			isec.Done()
			p.Items = append(p.Items, it)
		}
	} else if d, ok := sourceSettings(src).(ItemDefaulter); ok {
		p.Items = d.DefaultItems(p.Prefix, m)
	}
	return p
}

// systemDirs are directories kvmount refuses to own: a mount's content
// replaces what is there.
var systemDirs = []string{
	"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
	"/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp",
	"/usr", "/usr/bin", "/usr/lib", "/usr/lib64", "/usr/local", "/usr/local/bin",
	"/usr/sbin", "/usr/share", "/var", "/var/cache", "/var/lib", "/var/log", "/var/run",
	"/var/tmp", "/var/spool", "/etc/systemd", "/etc/ssl", "/etc/kvmount",
}

// checkDir rejects a mount dir that is not absolute, is a system directory
// or lies in a pseudo file system.
func checkDir(dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%q is not an absolute path", dir)
	}
	clean := filepath.Clean(dir)
	if slices.Contains(systemDirs, clean) {
		return fmt.Errorf("%q is a system directory; kvmount would replace its content", clean)
	}
	for _, pseudo := range []string{"/proc", "/sys", "/dev"} {
		if strings.HasPrefix(clean, pseudo+"/") {
			return fmt.Errorf("%q lies in %s", clean, pseudo)
		}
	}
	return nil
}

// checkMounts rejects duplicate names and dirs, nested mount dirs, and mount
// dirs that overlap the state directory. Each pair is reported once, on the
// later mount. It looks up each dir's ancestors among the others' dirs, so
// that 1,000 mounts cost 1,000 walks up a path rather than 500,000
// comparisons.
func checkMounts(mounts []*Section, cfg *Config) {
	names := map[string]int{}
	dirs := map[string]int{} // cleaned dir -> first mount with it
	for i, m := range cfg.Mounts {
		if checkDir(m.Dir) != nil {
			continue // reported by the mount's own checks
		}
		if _, ok := dirs[filepath.Clean(m.Dir)]; !ok {
			dirs[filepath.Clean(m.Dir)] = i
		}
	}
	for i, m := range cfg.Mounts {
		sec := mounts[i]
		if j, dup := names[m.Name]; dup && m.Name != "" {
			sec.Errorf("name", "mount name %q is already used by mount[%d]", m.Name, j)
		}
		names[m.Name] = i
		if checkDir(m.Dir) != nil {
			continue // already reported
		}
		if within(m.Dir, cfg.StateDir) || within(cfg.StateDir, m.Dir) {
			sec.Errorf("dir", "%q overlaps state_dir %q", m.Dir, cfg.StateDir)
		}
		if m.UID <= 0 {
			warnPlainTCP(sec, m, cfg)
		}
		clean := filepath.Clean(m.Dir)
		if j := dirs[clean]; j != i {
			sec.Errorf("dir", "%q is already the dir of mount[%d] (%s)", m.Dir, j, cfg.Mounts[j].Name)
		}
		for dir := filepath.Dir(clean); ; dir = filepath.Dir(dir) {
			if j, ok := dirs[dir]; ok {
				// m lies inside mount j's dir: reported on the later one.
				later, earlier := max(i, j), min(i, j)
				o := cfg.Mounts[earlier]
				mounts[later].Errorf("dir", "%q and the dir of mount[%d] (%s), %q, are nested", cfg.Mounts[later].Dir, earlier, o.Name, o.Dir)
			}
			if dir == "/" {
				break
			}
		}
	}
}

// within reports whether dir lies inside parent or is parent.
func within(dir, parent string) bool {
	return dir == parent || strings.HasPrefix(dir, strings.TrimSuffix(parent, "/")+"/")
}

// Nobody is the user and group a mount's commands run as when neither
// the configuration (check_user, notify_user) nor the mount's user names
// another: the overflow ids of Linux (65534, the nobody user and the
// nogroup group of Debian and Red Hat alike).
const Nobody = 65534

// EffectiveMaxSize returns the most bytes m's payload may hold: the
// smaller of max_mount_size and, on tmpfs, size_limit; 0 when neither
// bounds it.
func (m *Mount) EffectiveMaxSize() int64 {
	limit := m.MaxMountSize
	if m.Medium == MediumTmpfs && m.SizeLimit > 0 && (limit == 0 || m.SizeLimit < limit) {
		limit = m.SizeLimit
	}
	return limit
}

// FileModes returns the permission of each file of m's payloads, by its
// path (clean), as the configuration alone says: a template's mode for
// its path, an item's for its, else default_mode — the rule MakePayload
// applies, which the monitor applies again to what a worker sends, so
// that no worker chooses a mode.
func (m *Mount) FileModes() func(p string) fs.FileMode {
	explicit := map[string]fs.FileMode{}
	mode := func(set fs.FileMode) fs.FileMode {
		if set != 0 {
			return set.Perm()
		}
		return m.DefaultMode.Perm()
	}
	for _, pr := range m.Projections {
		for _, it := range pr.Items {
			if clean, err := projector.CleanPath(it.Path); err == nil {
				explicit[clean] = mode(it.Mode)
			}
		}
	}
	for _, t := range m.Templates {
		explicit[t.Path] = mode(t.Mode)
	}
	return func(p string) fs.FileMode {
		if set, ok := explicit[p]; ok {
			return set
		}
		return m.DefaultMode.Perm()
	}
}
