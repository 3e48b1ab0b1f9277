package config

import (
	"os"
	"os/user"
	"strconv"
)

// lookupID resolves the user or group name or numeric id at key; -1 when it
// is not set.
func lookupID(sec *Section, key string, lookup func(string) (int, error)) int {
	v := sec.String(key, "")
	if v == "" {
		return -1
	}
	if n, err := strconv.Atoi(v); err == nil {
		if n < 0 {
			sec.Errorf(key, "id %d is negative", n)
			return -1
		}
		return n
	}
	id, err := lookup(v)
	if err != nil {
		sec.Errorf(key, "%v", err)
		return -1
	}
	return id
}

// commandUser returns the user and group the mount's commands of key
// (check_user, notify_user) run as: the one key names — root only when
// named so, with a warning, since the command interprets what a store
// writer chose —; else the mount's user and group, unless that is root;
// else Nobody.
func commandUser(sec *Section, key string, m *Mount) (uid, gid int) {
	if sec.Has(key) {
		uid = lookupID(sec, key, lookupUser)
		if uid < 0 {
			return Nobody, Nobody
		}
		if uid == 0 {
			sec.Warnf(key, "commands of this mount run as root and interpret what the store's writers chose (a program that looks in its input for code or includes runs it as root); prefer the mount's user or nobody")
		}
		return uid, primaryGroup(uid)
	}
	if m.UID > 0 {
		gid := m.GID
		if gid < 0 {
			gid = primaryGroup(m.UID)
		}
		return m.UID, gid
	}
	return Nobody, Nobody
}

// warnUnreadable warns when m's check command runs as a user who cannot
// read the files the check reads: files owned by the mount's user (or
// root) with default_mode, as the check user's own, group or other bits
// allow.
func warnUnreadable(sec *Section, m *Mount) {
	owner, group := m.UID, m.GID
	if owner < 0 {
		owner = os.Geteuid()
	}
	if group < 0 {
		group = primaryGroup(owner)
	}
	key := "check_user"
	if !sec.Has(key) {
		key = "check_command"
	}
	mode := m.DefaultMode
	switch {
	case m.CheckUID == 0, m.CheckUID == owner && mode&0o400 != 0, m.CheckGID == group && mode&0o040 != 0, mode&0o004 != 0:
	default:
		sec.Warnf(key, "check_command runs as uid %d, who cannot read the mount's files (owner %d, group %d, mode %04o): set user or group, or check_user", m.CheckUID, owner, group, mode)
		return
	}
	// Until the check ends, the version's directories are root's, with the
	// mount's group and dir_mode — unless the check runs as their owner.
	dirMode := m.DirMode
	switch {
	case m.CheckUID == 0, m.CheckUID == m.UID, m.CheckGID == group && dirMode&0o050 == 0o050, dirMode&0o005 == 0o005:
	default:
		sec.Warnf(key, "check_command runs as uid %d, who cannot enter the new version's directories (root's while the check runs, group %d, dir_mode %04o): set group, or a dir_mode others can enter", m.CheckUID, group, dirMode)
	}
}

// UserID returns the user named at key — a name or a numeric id — or -1
// when key is not set; an unknown name is a problem at key's line.
func (s *Section) UserID(key string) int {
	return lookupID(s, key, lookupUser)
}

func lookupUser(name string) (int, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return -1, err
	}
	return strconv.Atoi(u.Uid)
}

// primaryGroup returns the primary group of the user uid from the user
// database, or uid itself when the database has no such user; -1 for -1.
func primaryGroup(uid int) int {
	if uid < 0 {
		return -1
	}
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		if gid, err := strconv.Atoi(u.Gid); err == nil {
			return gid
		}
	}
	return uid
}

func lookupGroup(name string) (int, error) {
	g, err := user.LookupGroup(name)
	if err != nil {
		return -1, err
	}
	return strconv.Atoi(g.Gid)
}
