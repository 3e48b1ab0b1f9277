package config

// Decoding and checking the [[mount]] tables, and what a mount's
// settings imply.

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvmount/kvmount/projector"
)

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
// comparisons. It warns once for each source that feeds mounts of root's
// over plain TCP (plainFeed).
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
	var feeds []*plainFeed
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
			feeds = notePlainTCP(feeds, sec, m, cfg)
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
	for _, f := range feeds {
		f.warn()
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
